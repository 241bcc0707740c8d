"""Argument types shared by several subcommands."""

from __future__ import annotations

import argparse

from ..common.seeds import MAX_SEED

MAX_LAYER_INDEX = 9_999  # far more decoder layers than any model has; the model's own count is checked later


def parse_layers(text: str) -> list[int]:
    """'0,1,5-7' -> [0, 1, 5, 6, 7]; a list that selects no layer ('', ',', '3-1') is an error, and so is an
    index above MAX_LAYER_INDEX (checked before a range is expanded: '0-999999999' allocates nothing)."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            bounds = [int(n) for n in part.split("-")] if "-" in part else [int(part)] if part.strip() else []
            if len(bounds) > 2 or any(n < 0 for n in bounds):
                raise ValueError(f"bad range {part}")
            if any(n > MAX_LAYER_INDEX for n in bounds):
                raise argparse.ArgumentTypeError(f"layer {max(bounds)} in {text!r}: no model has that many layers")
            if len(bounds) == 2:
                if bounds[0] > bounds[1]:
                    raise ValueError(f"empty range {part}")
                layers.extend(range(bounds[0], bounds[1] + 1))
            else:
                layers.extend(bounds)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"invalid layer list {text!r}; use e.g. 0,1,4-7") from err
    if not layers:
        raise argparse.ArgumentTypeError(f"layer list {text!r} selects no layer; use e.g. 0,1,4-7")
    return layers


def _number(text: str, cast: type, minimum: float, inclusive: bool, what: str):
    """argparse type body: TEXT cast to a finite number >= (or >) MINIMUM, else a one-line argparse error."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    low_ok = value >= minimum if inclusive else value > minimum
    if not low_ok or value == float("inf"):  # `not >=` also catches nan
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (steps, sizes)."""
    return _number(text, int, 0, False, "an integer")


def bounded_int(maximum: int, what: str = "", zero: bool = False):
    """argparse type factory: an integer from 1 (0 with ZERO) to MAXIMUM (sizes that allocate memory: capped before
    any does)."""

    def parse(text: str) -> int:
        value = _number(text, int, 0, zero, "an integer")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}{what}, got {text}")
        return value

    parse.__name__ = "bounded_int"  # argparse names the type in some messages
    return parse


def seed_int(text: str) -> int:
    """argparse type: a random seed, 0 .. 2**32 - 1 (numpy refuses others with a traceback)."""
    value = _number(text, int, 0, True, "an integer")
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be a seed from 0 to {MAX_SEED}, got {text}")
    return value


# Caps of the CLI's sizes, far above any real run, refused before anything is allocated.
MAX_BATCH = 65_536  # blocks (or documents) per device and step
MAX_SEQ_LEN = 1 << 20  # tokens per block
MAX_STEPS = 10**9


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1-65535."""
    value = _number(text, int, 1, True, "an integer")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (few-shot examples)."""
    return _number(text, int, 0, True, "an integer")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds)."""
    return _number(text, float, 0, False, "a number")


def rate_list(text) -> list[float]:
    """argparse type: comma-separated positive numbers ('1e-3,3e-3'), e.g. a learning-rate grid."""
    if isinstance(text, (list, tuple)):
        return list(text)
    try:
        values = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not (v > 0 and v != float("inf")) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive numbers, e.g. 1e-3,3e-3,1e-2")
    return values


MAX_FEWSHOT = 128  # more examples than any task's few-shot split holds (and than any context fits)


def fewshot_count(text: str) -> int:
    """argparse type: a number of few-shot examples, 0-128."""
    value = _number(text, int, 0, True, "an integer")
    if value > MAX_FEWSHOT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_FEWSHOT} few-shot examples, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (learning rates)."""
    return _number(text, float, 0, True, "a number")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks and shows each option's default (where it has one worth showing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.option_strings or action.nargs == "?"
        if "%(default)" in text or not shown or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments end in one line, `kha <command>: error: ...` (exit 2), like every other error of kha; help
    keeps the examples' line breaks (`HelpFormatter`, every subcommand's too)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None):
        """Arguments left over after a subcommand are that subcommand's error (`kha train: error: unrecognized
        arguments: ...`), not the top-level parser's (`kha: error:`)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(namespace, "command", None)
            parser = self._subcommand_parsers().get(command, self) if command else self
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def _subcommand_parsers(self) -> dict:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def call_with(func, args, *positional: str, **renamed: str):
    """FUNC(the options POSITIONAL, in order, then every other option of the parsed ARGS by name): a CLI module's one
    call into its part. RENAMED maps a parameter to the option that fills it where their names differ. An option
    FUNC has no parameter for is a TypeError here, so a renamed parameter never drops an option silently."""
    import inspect

    options = {name: value for name, value in vars(args).items() if name not in ("func", "command")}
    for parameter, option in renamed.items():
        options[parameter] = options.pop(option)
    values = [options.pop(name) for name in positional]
    unknown = sorted(set(options) - set(inspect.signature(func).parameters))
    if unknown:
        raise TypeError(f"{func.__qualname__} has no parameter for the option(s) {', '.join(unknown)}")
    return func(*values, **options)


def fraction(text: str) -> float:
    """argparse type: a number from 0 to 1 (a share of the run, of the peak learning rate)."""
    value = _number(text, float, 0, True, "a number")
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def add_schedule_arguments(p) -> None:
    """`--lr-scheduler` and its numbers, `--eval-steps` and `--peak-flops`: what `kha train` and `kha ab` share
    (training/schedules.py, training/throughput.py)."""
    from ..training.schedules import SCHEDULES

    group = p.add_argument_group("schedule, evaluation while training, throughput")
    group.add_argument(
        "--lr-scheduler",
        choices=SCHEDULES,
        default="cosine",
        help="cosine: the paper's, to --min-lr-ratio 0.1 of the peak; wsd: warmup, stable, then the last "
        "--decay-ratio (0.2) decayed to --min-lr-ratio (0); linear: to --min-lr-ratio (0); constant: the peak after "
        "warmup (transformers' own schedulers)",
    )
    warmup = group.add_mutually_exclusive_group()
    warmup.add_argument("--warmup-steps", type=bounded_int(MAX_STEPS, zero=True), help="linear warmup steps")
    warmup.add_argument("--warmup-ratio", type=fraction, help="warmup as a share of the run (default: 0.05)")
    group.add_argument("--min-lr-ratio", type=fraction, help="the floor of the decay, as a share of the peak")
    group.add_argument("--decay-ratio", type=fraction, help="wsd: the share of the run spent decaying (default: 0.2)")
    group.add_argument(
        "--eval-steps",
        type=bounded_int(MAX_STEPS),
        metavar="N",
        help="the loss on the validation split every N steps (never the held-out split), in trainer_state.json and "
        "the run's validation.jsonl",
    )
    group.add_argument(
        "--peak-flops",
        type=positive_float,
        metavar="FLOP/S",
        help="one device's peak FLOP/s (e.g. 989e12: an H100's dense bf16): each log then records MFU beside the "
        "model FLOP/s achieved",
    )

"""Argument types shared by several subcommands."""

from __future__ import annotations

import argparse


def parse_layers(text: str) -> list[int]:
    """'0,1,5-7' -> [0, 1, 5, 6, 7]; a list that selects no layer ('', ',', '3-1') is an error."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                if int(lo) > int(hi):
                    raise ValueError(f"empty range {part}")
                layers.extend(range(int(lo), int(hi) + 1))
            elif part.strip():
                layers.append(int(part))
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


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments end in one line, `kha <command>: error: ...` (exit 2), like every other error of kha."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks and shows each option's default (where it has one worth showing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.option_strings or action.nargs == "?"
        if "%(default)" in text or not shown or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"

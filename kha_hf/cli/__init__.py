"""The `kha` command: builds the parser from one thin module per subcommand and reports `KHAError` as one line.

Each `kha_hf/cli/<command>.py` holds `add_parser(sub)` (arguments only) and `run(args)` (one call into its part:
conversion, training, eval; an exit code, or None for success); nothing here computes.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..common.errors import KHAError
from ..common.supported_versions import versions_line
from . import ab, adapter, assets, convert, demo, fold, inspect, push, serve, tokenize, train, verify
from . import eval as eval_  # `eval_`: the module of `kha eval`, not the builtin
from ._common import OneLineErrorParser

EPILOG = """typical workflow:
  kha convert Qwen/Qwen3-0.6B ./qwen3-kha --knock mlp_v --verify   # upgrade, outputs unchanged
  kha verify Qwen/Qwen3-0.6B ./qwen3-kha                            # check parity again
  kha train ./qwen3-kha --output ./qwen3-kha-trained --mode knocks  # teach the knocks
  kha tokenize ./corpus/ --tokenizer ./qwen3-kha --output ./prepared # a corpus larger than memory, once
  kha eval --baseline Qwen/Qwen3-0.6B --candidate ./qwen3-kha-trained --suite quick
  kha inspect ./qwen3-kha-trained --plot knocks.png                 # what the knocks learned
  kha fold ./llama-kha-linear ./llama-folded                        # KHA-Linear -> plain checkpoint
  kha push ./qwen3-kha-trained me/qwen3-kha                         # share on the Hub
  kha serve ./qwen3-kha-trained --port 8000                         # OpenAI-compatible server (transformers)
  kha demo                                                          # all of it, offline, on SmolLM2-135M
  kha assets                                                        # where the offline model and data live
"""

# in the order of `kha --help`
COMMANDS = [convert, verify, tokenize, train, ab, eval_, inspect, fold, adapter, push, serve, demo, assets]
SUBCOMMANDS = [command.add_parser for command in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="kha",
        description="Knocking-Heads Attention (arXiv 2510.23052) for Hugging Face transformers.",
        epilog=EPILOG,
    )
    parser.add_argument(
        "--version", action="version", version=versions_line(), help="kha-hf's version and those it runs on"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .. import register_auto_classes

    register_auto_classes()  # deferred by the `kha` entry point until the arguments are known to be good
    _quiet_interrupted_progress_bars()
    try:
        return args.func(args) or 0  # a command's run returns an exit code, or None for success
    except KHAError as err:
        # one line whatever the message holds: a library's words (transformers' strict-dataclass errors) may not be
        message = " ".join(str(err).split())
        say_once(f"kha {args.command}: error: {message}")  # every rank of a launch refuses alike: one line
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM/SIGHUP while writing a checkpoint
        print(f"kha {args.command}: {str(err) or 'interrupted'}", file=sys.stderr)
        return 130
    except RecursionError:  # a hostile file nested thousands deep, past the checks that name it
        print(f"kha {args.command}: error: an input file nests too deeply to be read", file=sys.stderr)
        return 2
    except OSError as err:  # the file system said no (read-only, full, permissions): not a bug of kha
        print(f"kha {args.command}: error: {describe_os_error(err)}", file=sys.stderr)
        return 2


def say_once(line: str) -> None:
    """Print LINE on stderr, once per launch: the ranks of an `accelerate launch` / torchrun run (children of one
    launcher process) run the same checks and refuse alike, and the first to refuse says it; a rank whose refusal
    differs (its own file) still says its own. Ranks agree through a file of the lines said, locked while read and
    appended, in the temporary folder (named by the user and the launcher's process)."""
    if os.environ.get("WORLD_SIZE", "1").strip() in ("", "1", "0"):
        print(line, file=sys.stderr)
        return
    import fcntl
    import tempfile

    launch = f"{os.getuid()}-{os.getppid()}-{os.environ.get('MASTER_PORT', '')}"
    path = os.path.join(tempfile.gettempdir(), f"kha-said-{launch}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        with os.fdopen(fd, "r+", encoding="utf-8", errors="replace") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if os.fstat(f.fileno()).st_uid == os.getuid():  # never another user's file
                f.seek(0)
                if line + "\n" in f.read(1 << 20):
                    return
                f.write(line + "\n")
    except OSError:
        pass  # no agreement to be had: say it
    print(line, file=sys.stderr)


def describe_os_error(err: OSError) -> str:
    """One line for an OSError: what failed and on which file. A copy's error names its source first and its
    destination second (`shutil.copyfile`): when writing failed (disk full, file-size limit) the destination is
    the file that matters, named without kha's temporary folder (which is removed)."""
    import errno

    reason = err.strerror or str(err)
    if err.errno == errno.EFBIG:
        reason += " (a file-size limit of this process: ulimit -f)"
    if err.errno in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT) and err.filename2:
        return f"{reason}: writing {os.path.basename(err.filename2)}; nothing was written"
    return f"{reason}: {err.filename}" if err.filename else reason


def _quiet_interrupted_progress_bars() -> None:
    """A signal that lands inside tqdm's constructor leaves a half-built bar whose __del__ then fails ("Exception
    ignored in: <function tqdm.__del__>" and a traceback, after kha's one-line message). Such errors of tqdm's
    finaliser say nothing to the user: drop them; every other unraisable error is reported as before."""
    previous = sys.unraisablehook
    if getattr(previous, "_kha_quiet_tqdm", False):
        return

    def hook(unraisable):
        where = getattr(unraisable.object, "__qualname__", "") or type(unraisable.object).__qualname__
        module = getattr(unraisable.object, "__module__", "") or ""
        if module.startswith("tqdm") and where.endswith("__del__"):
            return
        previous(unraisable)

    hook._kha_quiet_tqdm = True
    sys.unraisablehook = hook


if __name__ == "__main__":
    sys.exit(main())

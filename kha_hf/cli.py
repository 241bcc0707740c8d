"""The `kha` command: argument parsing only; each subcommand calls a library function."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  kha convert Qwen/Qwen3-0.6B ./qwen3-0.6b-kha --knock mlp_v --verify
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kha",
        description="Knocking-Heads Attention (arXiv 2510.23052) for Hugging Face transformers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

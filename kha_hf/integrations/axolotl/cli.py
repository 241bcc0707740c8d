"""`axolotl kha-convert` and `axolotl kha-fold`: kha's `convert` and `fold` from Axolotl's command line.

kha-hf declares them in the `axolotl.cli_commands` entry-point group (setup.cfg); Axolotl imports this module only
when one of them runs. Every argument, `--help` included, goes to kha's own parser, so they take exactly what
`kha convert` and `kha fold` take (docs/guides/convert.md) and answer as they do (one line on bad input, exit 2).
"""

from __future__ import annotations

import sys

import click

PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


def _kha(command: str, args: list[str]) -> None:
    import kha_hf_entry  # the `kha` console script's entry point

    sys.argv = ["kha", command, *args]
    sys.exit(kha_hf_entry.main())


@click.command("kha-convert", context_settings=PASS_THROUGH, add_help_option=False)
@click.pass_context
def kha_convert(ctx: click.Context) -> None:
    """Convert a checkpoint to KHA (kha convert; --help for its options)."""
    _kha("convert", ctx.args)


@click.command("kha-fold", context_settings=PASS_THROUGH, add_help_option=False)
@click.pass_context
def kha_fold(ctx: click.Context) -> None:
    """Fold KHA-Linear knocks into a stock checkpoint or GGUF (kha fold; --help for its options)."""
    _kha("fold", ctx.args)

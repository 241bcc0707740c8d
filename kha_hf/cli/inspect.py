"""`kha inspect KHA_DIR`: knock statistics and heatmaps (kha_hf.conversion.knock_stats)."""

from __future__ import annotations

import sys

from ._common import HelpFormatter, non_negative_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="show how far each knock moved from identity, per layer (table, JSON, heatmaps)",
        description="Per layer and knock: Frobenius distance from the initial value, mean diagonal, off-diagonal "
        "mass, and for MLP gates their mean/std/max. Reads the knock tensors only.",
        epilog="examples:\n  kha inspect ./smollm2-kha-trained\n  kha inspect ./smollm2-kha-trained --plot knocks.png"
        "\n  kha inspect ./smollm2-kha-trained --plot all-layers.png --max-layers 0"
        "\n  kha inspect ./smollm2-kha-trained --json > knocks.json",
        formatter_class=HelpFormatter,
    )
    p.add_argument("kha_dir", metavar="KHA_DIR", help="a KHA checkpoint folder (only its knock tensors are read)")
    p.add_argument("--plot", metavar="PATH.png", help="write a heatmap grid (knocks x layers)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --plot file (never through a link)")
    p.add_argument(
        "--max-layers",
        type=non_negative_int,
        default=8,
        help="layers in the plot, evenly spaced from first to last (0: every layer)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from ..checkpoint.knock_reader import open_kha_checkpoint
    from ..checkpoint.output import atomic_output_file
    from ..checkpoint.paths import check_file_destination, check_place
    from ..conversion.knock_stats import check_plot_path, format_table, knock_statistics, plot_knocks, to_json

    if args.plot:
        check_plot_path(args.plot)  # before any work: a bad name is a one-line error
        check_file_destination(args.plot, args.overwrite)  # no link written through, no file replaced unasked
        check_place(args.plot, [Path(args.kha_dir)])  # KHA_DIR is read-only: no plot inside it
    kha = open_kha_checkpoint(args.kha_dir)  # read and checked once, for the table and the plot
    rows = knock_statistics(kha)
    print(to_json(rows) if args.json else format_table(rows))
    if args.plot:
        with atomic_output_file(args.plot, overwrite=args.overwrite) as tmp:  # appears complete, or not at all
            plot_knocks(kha, tmp, max_layers=args.max_layers or None)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0

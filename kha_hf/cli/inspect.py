"""`kha inspect KHA_DIR`: knock statistics and heatmaps (kha_hf.conversion.knock_stats)."""

from __future__ import annotations

from ._common import non_negative_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="show how far each knock moved from identity, per layer (table, JSON, heatmaps)",
        description="Per layer and knock: Frobenius distance from the initial value, mean diagonal, off-diagonal "
        "mass, and for MLP gates their mean/std/max. Reads the knock tensors only.",
        epilog="examples:\n  kha inspect ./smollm2-kha-trained\n  kha inspect ./smollm2-kha-trained --plot knocks.png"
        "\n  kha inspect ./smollm2-kha-trained --plot all-layers.png --max-layers 0"
        "\n  kha inspect ./smollm2-kha-trained --json > knocks.json",
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


def run(args) -> None:
    from ..conversion.knock_stats import inspect

    inspect(args.kha_dir, args.plot, args.overwrite, args.max_layers, args.json)

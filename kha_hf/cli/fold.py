"""`kha fold KHA_DIR OUT`: absorb KHA-Linear knocks into a plain checkpoint (kha_hf.conversion.fold)."""

from __future__ import annotations

from ._common import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser(
        "fold",
        help="absorb KHA-Linear knocks into q/k/v: a plain base-family checkpoint any engine serves",
        description="Fold every linear knock into its projection (per head, float64) and write a stock checkpoint "
        "of the base architecture (no remote code). MLP value knocks cannot be folded: refused, or with --partial "
        "(for mlp_v_linear_qk) Q/K are folded and the output stays a KHA model with the value MLP.",
        epilog="examples:\n  kha fold ./llama-kha-linear ./llama-folded\n"
        "  kha fold ./qwen3-kha-mlp-qk ./qwen3-kha-mlp --partial",
        formatter_class=HelpFormatter,
    )
    p.add_argument("kha_dir", metavar="KHA_DIR", help="a KHA checkpoint with linear knocks")
    p.add_argument("out", metavar="OUT", help="output folder (written atomically)")
    p.add_argument("--partial", action="store_true", help="fold linear Q/K knocks, keep the value MLP")
    p.add_argument("--link", action="store_true", help="hard-link shards that need no change")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..conversion.fold import fold

    result = fold(args.kha_dir, args.out, partial=args.partial, overwrite=args.overwrite, link=args.link)
    kind = "KHA checkpoint (value MLP kept)" if result.kept_kha else "plain checkpoint"
    print(f"wrote {result.output}: {kind}, {len(result.folded)} knock tensors folded")
    return 0

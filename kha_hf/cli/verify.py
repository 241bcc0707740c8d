"""`kha verify BASE KHA_DIR`: check that a converted checkpoint reproduces its base (kha_hf.conversion.verify)."""

from __future__ import annotations

from ._common import call_with


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check that a converted KHA checkpoint reproduces its base model",
        description="Load BASE and KHA_DIR, run fixed prompts, print max |Δlogit| and both greedy continuations; "
        "exit non-zero unless logits are identical (float32) or within 1e-2 (half precision).",
        epilog="example:\n  kha verify ./my-llama ./my-llama-kha --device cpu",
    )
    p.add_argument("base", metavar="BASE", help="base checkpoint folder, Hub id or .gguf file")
    p.add_argument("kha_dir", metavar="KHA_DIR", help="converted KHA checkpoint")
    p.add_argument("--device", default="cpu", help="where both models run: cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="tokenizer to use when KHA_DIR has none")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run model code shipped inside BASE (never by default)"
    )
    p.set_defaults(func=run)


def run(args) -> None:
    from ..conversion import verify_conversion

    call_with(verify_conversion, args, "base", "kha_dir")

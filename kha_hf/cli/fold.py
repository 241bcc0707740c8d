"""`kha fold KHA_DIR OUT`: absorb KHA-Linear knocks into a plain checkpoint (kha_hf.conversion.fold)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "fold",
        help="absorb KHA-Linear knocks into q/k/v: a plain base-family checkpoint any engine serves",
        description="Fold every linear knock into its projection (per head, float64) and write a stock checkpoint "
        "of the base architecture (no remote code). MLP value knocks cannot be folded: refused, or with --partial "
        "(for mlp_v_linear_qk) Q/K are folded and the output stays a KHA model with the value MLP. An OUT ending in "
        ".gguf is one GGUF file for llama.cpp / Ollama / LM Studio (llama, mistral, qwen2, qwen3, phi3, gemma3_text; "
        "a plain checkpoint of these families exports the same way), tokenizer and chat template included.",
        epilog="examples:\n  kha fold ./llama-kha-linear ./llama-folded\n"
        "  kha fold ./qwen3-kha-mlp-qk ./qwen3-kha-mlp --partial\n"
        "  kha fold ./smollm2-linear ./smollm2-folded.gguf --outtype q8_0",
    )
    p.add_argument("kha_dir", metavar="KHA_DIR", help="a KHA checkpoint with linear knocks")
    p.add_argument("out", metavar="OUT", help="output folder, or a .gguf file (written atomically)")
    p.add_argument("--partial", action="store_true", help="fold linear Q/K knocks, keep the value MLP")
    p.add_argument("--link", action="store_true", help="hard-link shards that need no change")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument(
        "--outtype",
        choices=["auto", "f32", "f16", "bf16", "q8_0"],
        default="auto",
        help="GGUF output only: type of the matrices (auto: as stored in KHA_DIR, lossless)",
    )
    p.add_argument(
        "--tokenizer-pre",
        metavar="NAME",
        help="GGUF output only: llama.cpp's pre-tokenizer type, for a BPE tokenizer whose type kha cannot recognise",
    )
    p.set_defaults(func=run)


def run(args) -> None:
    from ..conversion.fold import fold

    options = {"outtype": args.outtype, "tokenizer_pre": args.tokenizer_pre}
    print(fold(args.kha_dir, args.out, args.partial, args.overwrite, args.link, **options).summary)

"""`kha adapter KHA_DIR OUT`: a KHA checkpoint's knocks as a PEFT knock adapter (kha_hf.peft.adapter_files)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "adapter",
        help="save a KHA checkpoint's knocks as a PEFT knock adapter for its stock base model",
        description="Write the knocks of KHA_DIR as a knock adapter folder (adapter_config.json of type KNOCK and "
        "adapter_model.safetensors) that PeftModel.from_pretrained(stock_base, OUT) loads after `import kha_hf`, "
        "with the KHA model's logits. The reverse is `kha convert BASE DST --adapter OUT`.",
        epilog="examples:\n  kha adapter ./smollm2-kha-trained ./smollm2-knocks --base HuggingFaceTB/SmolLM2-135M\n"
        "  kha convert ./smollm2 ./smollm2-kha-again --adapter ./smollm2-knocks",
    )
    p.add_argument("kha_dir", metavar="KHA_DIR", help="a KHA checkpoint folder")
    p.add_argument("out", metavar="OUT", help="adapter folder to write (atomically)")
    p.add_argument("--base", metavar="NAME_OR_PATH", help="the stock base model, recorded for AutoPeftModel")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT that kha wrote")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..peft.adapter_files import write_knock_adapter

    out, count = write_knock_adapter(args.kha_dir, args.out, base=args.base, overwrite=args.overwrite)
    print(f"wrote {out}: a knock adapter of {count:,} parameters")

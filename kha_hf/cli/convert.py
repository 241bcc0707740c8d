"""`kha convert SRC DST`: upgrade a base checkpoint to KHA (kha_hf.conversion.convert)."""

from __future__ import annotations

from ..modeling.configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS
from ._common import call_with, parse_layers


def knock_preset(text: str) -> str:
    """argparse type: a knock preset; an ablation variant with random knocks (mlp_v_random) passes, for `convert` to
    refuse saying why."""
    import argparse

    if text.endswith("_random") and text.removesuffix("_random") in KNOCK_PRESETS:
        return text
    if text not in KNOCK_PRESETS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text[:60]!r} (choose from {', '.join(sorted(KNOCK_PRESETS))})"
        )
    return text


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="upgrade a Llama/Mistral/Qwen checkpoint (folder, Hub id or GGUF) to KHA, streaming",
        description="Upgrade a base checkpoint to KHA with identity knocks: outputs are unchanged until trained. "
        "Safetensors sources are streamed (headers only, shards copied or linked); GGUF files are dequantised.",
        epilog="examples:\n"
        "  kha convert Qwen/Qwen3-0.6B ./qwen3-0.6b-kha --knock mlp_v --verify\n"
        "  kha convert ./my-llama ./my-llama-kha --knock linear_qkv --link\n"
        "  kha convert ./SmolLM2-135M.Q4_1.gguf ./smollm2-kha\n"
        "  kha convert ./my-llama ./my-llama-kha --push-to-hub me/my-llama-kha\n"
        "  kha convert ./my-llama ./my-llama-kha --adapter ./my-knock-adapter",
    )
    p.add_argument("src", metavar="SRC", help="checkpoint folder, Hub id (owner/name) or .gguf file")
    p.add_argument("dst", metavar="DST", help="output folder (written atomically)")
    p.add_argument(
        "--knock", default=None, type=knock_preset, metavar="{" + ",".join(sorted(KNOCK_PRESETS)) + "}",
        help=f"knock preset (default: {DEFAULT_KNOCK})",
    )  # fmt: skip
    p.add_argument(
        "--knock-layers", type=parse_layers, default=None, help="layers to knock, e.g. 0,1,8-15 (default all)"
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--link", action="store_true", help="hard-link the original shards")
    group.add_argument("--copy", dest="link", action="store_false", help="copy the shards byte for byte (default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights (default: keep)")
    p.add_argument("--verify", action="store_true", help="check identical logits before writing DST")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the result to this Hub repo")
    p.add_argument("--private", action="store_true", help="make the Hub repo private")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--revision", help="Hub revision of SRC")
    p.add_argument(
        "--adapter",
        metavar="ADAPTER_DIR",
        help="a knock adapter (PEFT, KnockConfig) trained on SRC: DST gets its knocks, types and layers instead of "
        "identity knocks (the servable form of an adapter whose MLP knocks cannot merge)",
    )
    p.set_defaults(func=run)


def run(args) -> None:
    from ..conversion import convert

    result = call_with(convert, args, "src", "dst", trained_knocks="adapter")
    preset = result.config.knock_preset or "custom"
    origin = f", trained, from {args.adapter}" if args.adapter else ""
    print(f"wrote {result.output}: {len(result.knock_tensors)} knock tensors ({preset}{origin})")

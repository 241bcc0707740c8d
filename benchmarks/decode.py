"""Prefill and per-token decode with the KV cache: baseline vs KHA presets vs a folded KHA-Linear model.

Per decode step it also counts the operators the step runs (torch.profiler), separating the cost of extra
kernels from extra arithmetic: the knocks add few FLOPs (2·d_h² per head-row per matrix) but several small ops.

    python benchmarks/decode.py              # CPU shape, or with CUDA the reference shape (24 layers, hidden 2048)
    python benchmarks/decode.py --quick      # seconds, for CI
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import PRESETS, header, interleaved_medians, qwen3_config, ratio_table, twins
from transformers import DynamicCache

from kha_hf.modeling.families import STANDARD, segment_rows
from kha_hf.modeling.knocks import fold_projection


def folded_copy(kha_linear, base_cls):
    """A stock model whose projections absorbed KHA-Linear knocks (in memory, same math as `kha fold`)."""
    base = base_cls(kha_linear.config.to_base_config()).to(kha_linear.device, kha_linear.dtype).eval()
    state = {k: v for k, v in kha_linear.state_dict().items() if "_knock." not in k}
    for i, layer in enumerate(kha_linear.model.layers):
        attn = layer.self_attn
        for target in ("q", "k", "v"):
            knock = getattr(attn, f"{target}_knock")
            if knock is not None:
                key = f"model.layers.{i}.self_attn.{target}_proj.weight"
                rows = segment_rows(kha_linear.config, STANDARD[f"{target}_proj"], target)
                state[key] = fold_projection(state[key], knock.weight.detach(), rows)
    base.load_state_dict(state)
    return base


def prefill_fn(model, prompt):
    def run():
        with torch.no_grad():
            model(prompt, cache=DynamicCache(config=model.config), use_cache=True)

    return run


def decode_fn(model, prompt, steps: int):
    """Prefill once (untimed), then time `steps` single-token steps per call (cache rebuilt from a copy)."""
    with torch.no_grad():
        out = model(prompt, cache=DynamicCache(config=model.config), use_cache=True)
    prefix_cache = out.cache
    token = out.logits[:, -1:].argmax(-1)

    def run():
        cache = copy.deepcopy(prefix_cache)
        next_token = token
        with torch.no_grad():
            for _ in range(steps):
                logits = model(next_token, cache=cache, use_cache=True).logits
                next_token = logits[:, -1:].argmax(-1)

    return run


def generate_fn(model, prompt, new_tokens: int, device: str):
    """generate() with a static cache, which transformers compiles for the decode steps (CUDA graphs on GPU)."""
    from transformers import CompileConfig

    compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device == "cuda" else "default")
    compile_config._compile_all_devices = device != "cuda"  # transformers only auto-compiles on accelerators

    def run():
        model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            compile_config=compile_config,
            pad_token_id=0,
        )

    return run


def compiled_decode(models: dict, prompt, steps: int, repeats: int, device: str) -> dict:
    """Per-token decode time under torch.compile + static cache: (t(1 + steps tokens) - t(1 token)) / steps."""
    full = {n: generate_fn(m, prompt, 1 + steps, device) for n, m in models.items()}
    one = {n: generate_fn(m, prompt, 1, device) for n, m in models.items()}
    for fn in [*full.values(), *one.values()]:  # compile (and warm up) outside the timed rounds
        fn()
    t_full = interleaved_medians(full, repeats, 1, device)
    t_one = interleaved_medians(one, repeats, 1, device)
    return {n: (t_full[n] - t_one[n]) / steps for n in models}


def ops_per_step(model, prompt) -> int:
    with torch.no_grad():
        out = model(prompt, cache=DynamicCache(config=model.config), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        with torch.profiler.profile() as prof:
            model(token, cache=out.cache, use_cache=True)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also time decode under torch.compile + static cache")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.quick:
        shape = dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, kv_len=64, steps=4)
    elif cuda:
        shape = dict(hidden=2048, layers=24, heads=32, kv_heads=4, head_dim=128, kv_len=2048, steps=32)
    else:
        shape = dict(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, kv_len=512, steps=16)
    dtype = torch.bfloat16 if cuda else torch.float32
    repeats = 3 if args.quick else 15
    config = qwen3_config(shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"])
    models = twins(config, PRESETS, args.device, dtype)
    models["linear_qkv folded"] = folded_copy(models["linear_qkv"], type(models["baseline"]))
    prompt = torch.randint(0, config.vocab_size, (args.batch, shape["kv_len"]), device=args.device)

    print(header("prefill and per-token decode with the KV cache", args.device))
    print(f"shape {shape}, batch {args.batch}, {dtype}, sdpa, eager PyTorch, {repeats} interleaved rounds\n")
    prefill = interleaved_medians({n: prefill_fn(m, prompt) for n, m in models.items()}, repeats, 1, args.device)
    print(f"prefill of {shape['kv_len']} tokens\n")
    print(ratio_table(prefill))
    decode = interleaved_medians(
        {n: decode_fn(m, prompt, shape["steps"]) for n, m in models.items()}, repeats, 1, args.device
    )
    decode = {n: t / shape["steps"] for n, t in decode.items()}
    ops = {n: {"top-level aten ops / step": ops_per_step(m, prompt)} for n, m in models.items()}
    print(f"\nper-token decode (KV length {shape['kv_len']})\n")
    print(ratio_table(decode, extra=ops))
    if args.compile:
        names = ("baseline", "mlp_v") if args.quick else ("baseline", "mlp_v", "linear_v", "linear_qkv folded")
        subset = {n: models[n] for n in names}  # --quick: two compilations show the path works (15 s each on CPU)
        compiled = compiled_decode(subset, prompt, shape["steps"], repeats, args.device)
        mode = "CUDA graphs (reduce-overhead)" if cuda else "inductor, default mode"
        print(f"\nper-token decode under torch.compile + static cache ({mode})\n")
        print(ratio_table(compiled))


if __name__ == "__main__":
    main()

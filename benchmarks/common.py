"""Shared benchmark helpers: build baseline and KHA twins from one set of weights, time them interleaved."""

from __future__ import annotations

import copy
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kha_hf import KHAForCausalLM

# the method's presets, then the paper's ablation rows (MLP on Q, K, QKV; linear on Q, K; the gate-only control)
PRESETS = [
    "mlp_v",
    "linear_v",
    "linear_qkv",
    "mlp_v_linear_qk",
    "mlp_q",
    "mlp_k",
    "mlp_qkv",
    "linear_q",
    "linear_k",
    "gate_v",
]


def header(title: str, device: str) -> str:
    gpu = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or platform.machine()} CPU"
    return (
        f"# {title}\n{datetime.date.today()}, {gpu}, torch {version('torch')}, transformers {version('transformers')}, "
        f"threads {torch.get_num_threads()}"
    )


def qwen3_config(
    hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int = 32000, attn: str = "sdpa"
) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=16384,
    )
    config._attn_implementation = attn
    return config


def twins(config: Qwen3Config, presets: list[str], device: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """{"baseline": stock Qwen3, preset: KHA of the same weights} on device/dtype, in eval mode."""
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(config).to(device, dtype).eval()
    models = {"baseline": base}
    for preset in presets:
        models[preset] = KHAForCausalLM.from_base(copy.deepcopy(base), knock=preset).eval()
    return models


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device: str) -> dict:
    """Run each fn `warmup` times, then `repeats` rounds in rotating order; median seconds per fn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            fns[name]()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def ratio_table(medians: dict[str, float], unit: str = "ms", scale: float = 1e3, extra: dict | None = None) -> str:
    base = medians["baseline"]
    cols = list((extra or {}).get("baseline", {}))
    lines = [
        f"| variant | median ({unit}) | ratio vs baseline |" + "".join(f" {c} |" for c in cols),
        "|---|---|---|" + "---|" * len(cols),
    ]
    for name, value in medians.items():
        more = "".join(f" {(extra or {}).get(name, {}).get(c, '')} |" for c in cols)
        lines.append(f"| {name} | {value * scale:.3f} | {value / base:.3f}x |{more}")
    return "\n".join(lines)

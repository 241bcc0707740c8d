"""Converter time and peak RSS vs naive load-modify-save, at two checkpoint sizes, side by side.

Each measurement runs in a fresh interpreter that reports its own peak RSS (ru_maxrss), so the numbers include
the interpreter and its imports (torch, transformers); the bare-import row shows that floor. Linux carries a
parent's peak RSS into its children, so this driver stays small: it imports no torch and has the synthetic
checkpoints written by a child process too.

    python benchmarks/convert_memory.py            # ~0.2 GB and ~2 GB synthetic Llama checkpoints (bf16)
    python benchmarks/convert_memory.py --quick    # one ~20 MB checkpoint, for CI
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = r"""
import json, resource, sys, time
start = time.perf_counter()
mode, src, dst = sys.argv[1:4]
if mode == "import":
    import kha_hf  # noqa: F401
elif mode == "stream":
    from kha_hf.conversion import convert
    convert(src, dst, knock="mlp_v", progress=False)
elif mode == "stream-link":
    from kha_hf.conversion import convert
    convert(src, dst, knock="mlp_v", link=True, progress=False)
elif mode == "prepare-linear":
    from kha_hf.conversion import convert
    convert(src, dst, knock="linear_qkv", link=True, progress=False)
elif mode == "fold":
    from kha_hf.conversion.fold import fold
    fold(src, dst, progress=False)
elif mode == "naive":
    import torch
    from kha_hf import KHAForCausalLM
    model = KHAForCausalLM.from_pretrained(src, knock="mlp_v", dtype=torch.bfloat16)
    model.save_pretrained(dst)
print(json.dumps({"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - start}))
"""


def write_synthetic_llama(folder: Path, layers: int, hidden: int, vocab: int = 32000) -> float:
    """A Llama checkpoint of random bf16 weights, one shard per few layers; returns its size in GiB."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    heads, kv_heads, inter = hidden // 64, max(1, hidden // 256), int(hidden * 8 / 3) // 64 * 64
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    d = hidden // heads

    def layer_tensors(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (heads * d, hidden),
            "self_attn.k_proj.weight": (kv_heads * d, hidden),
            "self_attn.v_proj.weight": (kv_heads * d, hidden),
            "self_attn.o_proj.weight": (hidden, heads * d),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }
        return {p + k: (torch.randn(s) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}

    groups = [list(range(i, min(i + 4, layers))) for i in range(0, layers, 4)]
    shards = [{"model.embed_tokens.weight": (torch.randn(vocab, hidden) * 0.02).to(torch.bfloat16)}]
    shards += [None] * len(groups)
    weight_map, total = {}, 0
    n = len(shards) + 1
    for idx in range(n):
        if idx == 0:
            tensors = shards[0]
        elif idx <= len(groups):
            tensors = {k: v for i in groups[idx - 1] for k, v in layer_tensors(i).items()}
        else:
            tensors = {
                "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                "lm_head.weight": (torch.randn(vocab, hidden) * 0.02).to(torch.bfloat16),
            }
        name = f"model-{idx + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total / 2**30


def measure(mode: str, src: Path, dst: Path) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", RUNNER, mode, str(src), str(dst)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small checkpoints (CI smoke run)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--make", nargs=4, metavar=("DIR", "LAYERS", "HIDDEN", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:
        folder, layers, hidden, vocab = args.make
        print(write_synthetic_llama(Path(folder), int(layers), int(hidden), int(vocab)))
        return
    # --quick checks that the script runs (one small checkpoint); the recorded table is the two full sizes
    sizes = [(4, 256, 8000)] if args.quick else [(8, 896, 32000), (24, 2048, 32000)]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kha-bench-"))
    from importlib.metadata import version

    print(
        f"# converter memory, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {version('torch')}, transformers {version('transformers')}"
    )
    print("| checkpoint | method | peak RSS (MiB) | wall (s) | RSS vs naive |")
    print("|---|---|---|---|---|")
    floor = measure("import", work, work / "none")
    print(f"| - | bare `import kha_hf` | {floor['rss_mib']:.0f} | {floor['seconds']:.1f} | |")
    try:
        for layers, hidden, vocab in sizes:
            src = work / f"llama-{layers}x{hidden}"
            made = subprocess.run(
                [sys.executable, __file__, "--make", str(src), str(layers), str(hidden), str(vocab)],
                capture_output=True,
                text=True,
                check=True,
            )
            gib = float(made.stdout.strip())
            rows = {mode: measure(mode, src, work / f"out-{mode}") for mode in ("naive", "stream", "stream-link")}
            for mode, r in rows.items():
                ratio = r["rss_mib"] / rows["naive"]["rss_mib"]
                label = {
                    "naive": "naive load-modify-save",
                    "stream": "kha convert (copy)",
                    "stream-link": "kha convert --link",
                }[mode]
                print(f"| {gib:.2f} GiB bf16 | {label} | {r['rss_mib']:.0f} | {r['seconds']:.1f} | {ratio:.2f}x |")
            # fold reads one shard at a time: its peak grows with the largest shard, not with the model
            measure("prepare-linear", src, work / "linear")
            r = measure("fold", work / "linear", work / "out-fold")
            shard = max(p.stat().st_size for p in src.glob("*.safetensors")) / 2**20
            print(
                f"| {gib:.2f} GiB bf16 | kha fold (linear_qkv; largest shard {shard:.0f} MiB) | {r['rss_mib']:.0f} | "
                f"{r['seconds']:.1f} | {r['rss_mib'] / rows['naive']['rss_mib']:.2f}x |"
            )
            for mode in [*rows, "fold"]:
                shutil.rmtree(work / f"out-{mode}", ignore_errors=True)
            shutil.rmtree(work / "linear", ignore_errors=True)
            shutil.rmtree(src)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

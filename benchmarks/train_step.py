"""Training step (forward + backward of the decoder stack) and peak training memory: baseline vs each KHA preset.

Baseline and KHA twins share weights and run interleaved in one process; medians and ratios are printed.

    python benchmarks/train_step.py             # CPU shape (fp32) or, with CUDA, the paper's shape (bf16, sdpa)
    python benchmarks/train_step.py --quick     # seconds, for CI
"""

from __future__ import annotations

import argparse
import gc

import torch
from common import PRESETS, header, interleaved_medians, qwen3_config, ratio_table, twins


def step_fn(model, ids):
    body = model.model  # the decoder stack: what the knocks change (the LM head is identical)

    def run():
        model.zero_grad(set_to_none=True)
        hidden = body(input_ids=ids).last_hidden_state
        hidden.float().pow(2).mean().backward()

    return run


def saved_for_backward_mib(model, ids) -> float:
    """Bytes autograd keeps for the backward pass (activations, and the weights the matmuls need), deduplicated
    by storage: the part of training memory that KHA can change, measurable on any device."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model.model(input_ids=ids).last_hidden_state.float().pow(2).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile each model's decoder stack")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.quick:
        shape = dict(hidden=128, layers=1, heads=4, kv_heads=2, head_dim=32, seq=128, batch=1)
    elif cuda:  # the paper's attention shape
        shape = dict(hidden=2048, layers=2, heads=32, kv_heads=4, head_dim=128, seq=4096, batch=2)
    else:
        shape = dict(hidden=512, layers=2, heads=8, kv_heads=2, head_dim=64, seq=512, batch=2)
    dtype = torch.bfloat16 if cuda else torch.float32
    repeats = args.repeats or (3 if args.quick else 20)
    config = qwen3_config(
        shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"], vocab=1024
    )
    models = twins(config, PRESETS, args.device, dtype)
    for model in models.values():
        model.train()
        if args.compile:
            model.model = torch.compile(model.model)
    ids = torch.randint(0, 1024, (shape["batch"], shape["seq"]), device=args.device)
    medians = interleaved_medians({n: step_fn(m, ids) for n, m in models.items()}, repeats, 2, args.device)

    memory = {name: {"saved for backward (MiB)": f"{saved_for_backward_mib(m, ids):.1f}"} for name, m in models.items()}
    if cuda:
        for name, model in models.items():
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            step_fn(model, ids)()
            torch.cuda.synchronize()
            memory[name]["CUDA peak (MiB)"] = f"{torch.cuda.max_memory_allocated() / 2**20:.0f}"
    print(header("training step (forward + backward)", args.device))
    print(f"shape {shape}, {dtype}, sdpa{', compiled' if args.compile else ''}, {repeats} interleaved rounds\n")
    print(ratio_table(medians, extra=memory))


if __name__ == "__main__":
    main()

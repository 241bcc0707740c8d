"""One rank of tests/training/test_parallel_layouts.py, started by torch.distributed.run on 2 CPU processes (gloo):
loads MODEL_DIR laid out as LAYOUT with kha's own loader (kha_hf.training.parallel.load_sharded, what kha train
runs), computes the logits of fixed ids, and writes what this rank saw to OUT/rank<N>.json.

    python -m torch.distributed.run --nproc_per_node 2 tests/training/parallel_worker.py LAYOUT MODEL_DIR OUT
"""

import json
import sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from kha_hf import KHAForCausalLM
from kha_hf.training.parallel import ParallelPlan, load_sharded

LAYOUTS = {
    "fsdp": ParallelPlan(2, fsdp_size=2),
    "tp": ParallelPlan(2, fsdp_size=1, tp_size=2),
    "ep": ParallelPlan(2, fsdp_size=1, tp_size=2, ep_size=2),  # the expert plan alone across the 2 ranks
    "fsdp+ep": ParallelPlan(2, fsdp_size=2, ep_size=2),
}


def local_numel(tensor) -> int:
    return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()


def touched_rss(load) -> tuple:
    """LOAD()'s model, and how much this process's resident memory (KiB) grew by loading it and reading every element
    it holds (a checkpoint's weights may stay pages of the mapped file until read: reading them counts them)."""
    process = psutil.Process()
    before = process.memory_info().rss
    model = load()
    process = psutil.Process()
    before = process.memory_info().rss
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.sum().item()  # no copy: only the pages it holds are read
    return model, (process.memory_info().rss - before) // 1024


def main(layout: str, model_dir: str, out: str) -> None:
    if layout == "plain":  # one process, the reference for the memory of a whole load
        _, grown = touched_rss(lambda: KHAForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
        (Path(out) / "plain.json").write_text(json.dumps({"load_rss_kib": grown}))
        return
    dist.init_process_group("gloo")  # before the measure: what a rank holds for the group itself is not the model's
    torch.zeros(1).to_dense()
    model, grown = touched_rss(lambda: load_sharded(KHAForCausalLM, model_dir, LAYOUTS[layout], dtype=torch.float32))
    model.eval()
    ids = torch.arange(3, 3 + 2 * 24).reshape(2, 24) % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    params = dict(model.named_parameters())
    rank = dist.get_rank()
    saved = None
    if layout == "fsdp":  # a save of the sharded model: every rank joins the gather, rank 0 writes
        saved = Path(out) / "saved"
        model.save_pretrained(saved, is_main_process=rank == 0)
    record = {
        "logits": logits.tolist(),
        "class": type(model).__name__,
        "dtensor": sorted(n for n, p in params.items() if hasattr(p, "to_local")),
        "local": {n: local_numel(p) for n, p in params.items()},
        "global": {n: p.numel() for n, p in params.items()},
        "load_rss_kib": grown,
        "saved": str(saved) if saved else None,
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])

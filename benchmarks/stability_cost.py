"""What the stability records cost a training step (training/stability.py): the same KHA model's forward + backward
with the attention-logit probe installed but idle (every step but the K-th) and probing (the K-th step), against
plain SDPA. The per-step records (loss, gradient norms, learning rate) are a few reductions over the gradients per
optimizer step and are not timed here. A probe every K steps costs (probing − idle) / K of a step on average.

    python benchmarks/stability_cost.py            # a few minutes on 2 CPU cores
    python benchmarks/stability_cost.py --quick    # seconds, for CI
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import header, interleaved_medians, qwen3_config, ratio_table
from train_step import step_fn

from kha_hf import KHAForCausalLM
from kha_hf.training.stability import StabilityLog, start_probing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.quick:
        shape = dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, seq=128, batch=1)
    elif cuda:  # the paper's attention shape
        shape = dict(hidden=2048, layers=2, heads=32, kv_heads=4, head_dim=128, seq=4096, batch=2)
    else:  # cpu-tiny's shape (kha ab's CPU preset)
        shape = dict(hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, seq=256, batch=8)
    dtype = torch.bfloat16 if cuda else torch.float32
    repeats = 3 if args.quick else 30
    config = qwen3_config(shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"], 1024)
    torch.manual_seed(0)
    from transformers import Qwen3ForCausalLM

    base = Qwen3ForCausalLM(config).to(args.device, dtype)
    plain = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v").train()
    probed = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v").train()
    log = StabilityLog(logit_every=1)
    assert start_probing(probed, log), "the probe needs SDPA"
    ids = torch.randint(0, 1024, (shape["batch"], shape["seq"]), device=args.device)
    idle_step, probing_step = step_fn(probed, ids), step_fn(probed, ids)

    def idle():
        log.probing = False
        idle_step()

    def probing():
        log.probing = True
        probing_step()
        log._logits.clear()

    medians = interleaved_medians(
        {"baseline": step_fn(plain, ids), "probe installed, idle": idle, "probing (the K-th step)": probing},
        repeats,
        2,
        args.device,
    )
    print(header("stability probe: training step (forward + backward), KHA mlp_v", args.device))
    print(f"shape {shape}, {dtype}, sdpa, {repeats} interleaved rounds; baseline: the same model without the probe\n")
    print(ratio_table(medians))
    extra = medians["probing (the K-th step)"] / medians["probe installed, idle"] - 1
    for k in (1, 10, 50):
        print(f"probe every {k} steps: +{100 * extra / k:.2f} % per step on average")


if __name__ == "__main__":
    main()

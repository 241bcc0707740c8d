"""`kha train` in two processes through accelerate (gloo on CPUs): DDP and FSDP2 runs (FSDP2: transformers shards the
model at load time, on CPUs as on GPUs) match a one-process run with the same global batch, every rank ends with the
same knocks, the run's record (stability.jsonl) is the run's and not rank 0's, and the saved checkpoint loads with
from_pretrained.

accelerate 1.x starts a single process for `accelerate launch --cpu --num_processes 2` (its multi-CPU mode needs
mpirun); `--multi_gpu` on a machine without GPUs starts torch.distributed's launcher, and the processes use gloo.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from kha_hf import KHAForCausalLM
from kha_hf.training.stability import read_stability_lines
from tests.helpers import free_port
from tests.training.engines import EXPECTED

TOLERANCE = 1e-4  # per logged loss: the same batches, reduced in another order
FSDP_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
mixed_precision: 'no'
main_process_port: {port}
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
  fsdp_reshard_after_forward: true
"""


def kha_train(args: list[str], launcher: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_CONFIG_FILE": str(tmp_path / "none.yaml")}
    proc = subprocess.run(
        [*launcher, "-m", "kha_hf", "train", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def losses(out) -> list[float]:
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one(corpus, kha_dir, tmp_path, strategy):
    data, _ = corpus
    mode = "knocks" if strategy == "ddp" else "full"
    common = [str(kha_dir), "--data", str(data), "--max-steps", "4", "--seq-len", "64", "--logging-steps", "1"]
    common += ["--mode", mode, "--lr", "1e-2"]
    kha_train([*common, "--output", str(tmp_path / "one"), "--batch-size", "4"], [sys.executable], tmp_path)
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if strategy == "ddp":
        launch += ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    else:
        (tmp_path / "fsdp.yaml").write_text(FSDP_CONFIG.format(port=free_port()))
        launch += ["--config_file", str(tmp_path / "fsdp.yaml")]
    two = kha_train([*common, "--output", str(tmp_path / "two"), "--batch-size", "2"], launch, tmp_path)

    assert "knocks identical on all 2 ranks" in two.stdout
    engine = EXPECTED["fsdp2-full" if strategy == "fsdp" else "ddp"]
    assert f"engine: {engine} on 2 process(es)" in two.stdout
    one_losses, two_losses = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one_losses) == len(two_losses) == 4
    assert max(abs(a - b) for a, b in zip(one_losses, two_losses, strict=True)) < TOLERANCE, (one_losses, two_losses)

    # one record per run: each step's loss in stability.jsonl is the mean over ranks, as Trainer logs it (each rank
    # trained on its half of the global batch: rank 0's own loss was up to 0.19 off), and 1 process's
    recorded = [row["loss"] for row in read_stability_lines(tmp_path / "two" / "stability.jsonl")]
    alone = [row["loss"] for row in read_stability_lines(tmp_path / "one" / "stability.jsonl")]
    assert max(abs(a - b) for a, b in zip(recorded, two_losses, strict=True)) < 1e-6, (recorded, two_losses)
    assert max(abs(a - b) for a, b in zip(recorded, alone, strict=True)) < TOLERANCE, (recorded, alone)
    summary = json.loads((tmp_path / "two" / "train_results.json").read_text())
    rows = read_stability_lines(tmp_path / "two" / "stability.jsonl")
    assert summary["max_grad_norm"] == max(row["grad_norm"] for row in rows)

    # the saved checkpoint loads exactly: what from_pretrained builds is what the file holds, and the
    # two-process model computes what the one-process model computes
    saved = load_file(tmp_path / "two" / "model.safetensors")
    model = KHAForCausalLM.from_pretrained(tmp_path / "two").eval()
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    reference = KHAForCausalLM.from_pretrained(tmp_path / "one").eval()
    ids = torch.randint(3, 500, (1, 16))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() < 1e-3

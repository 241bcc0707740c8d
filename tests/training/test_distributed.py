"""`kha train` in two processes through accelerate (gloo on CPUs): DDP runs (and FSDP2 runs, on a GPU machine: on
CPUs accelerate 1.16 trains an FSDP config with DDP) match a one-process run with the same global batch, every rank
ends with the same knocks, and the saved checkpoint loads with from_pretrained.

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
from tests.helpers import free_port
from tests.training.engines import NEEDS_GPU

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


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=NEEDS_GPU)])
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
    engine = "FSDP2 (FULL_STATE_DICT)" if strategy == "fsdp" else ("DDP" if torch.cuda.is_available() else "DDP (CPU)")
    assert f"engine: {engine} on 2 process(es)" in two.stdout
    one_losses, two_losses = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one_losses) == len(two_losses) == 4
    assert max(abs(a - b) for a, b in zip(one_losses, two_losses, strict=True)) < TOLERANCE, (one_losses, two_losses)

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

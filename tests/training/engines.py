"""Shared by the multi-process training tests: `kha train` under `accelerate launch` with the shipped configs
(examples/accelerate/*.yaml: 2 CPU processes, gloo), a prepared corpus, and readers of what a run leaves."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kha_hf.data.corpus import open_corpus
from tests.helpers import free_port

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "accelerate"
# what each shipped config runs, as `kha train` prints it ("engine: ... on 2 process(es)"). kha train takes an FSDP2
# config as its plan and transformers shards the model at load time, on CPUs (gloo) as on GPUs (training/parallel.py)
SHARDED_AT_LOAD = ", sharded at load by transformers' DistributedConfig"
EXPECTED = {
    "ddp": "DDP" if torch.cuda.is_available() else "DDP (CPU)",
    "fsdp2-full": "FSDP2 (FULL_STATE_DICT)" + SHARDED_AT_LOAD,
    "fsdp2-sharded": "FSDP2 (SHARDED_STATE_DICT)" + SHARDED_AT_LOAD,
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
}


def engines(*names: str, exhaustive: tuple[str, ...] = ()) -> list:
    """NAMES as pytest parameters; those in EXHAUSTIVE marked for the exhaustive tier (tests/conftest.py)."""
    return [pytest.param(name, marks=[pytest.mark.exhaustive] if name in exhaustive else []) for name in names]


ENGINES = ("ddp", "fsdp2-full", "fsdp2-sharded", "zero2", "zero3")
RUN = ["--seq-len", "64", "--logging-steps", "1"]


def launcher(engine: str | Path | None) -> list[str]:
    """The command that starts `python -m kha_hf` on 1 process (None) or on 2 with ENGINE's shipped config (or the
    config file ENGINE names)."""
    if engine is None:
        return [sys.executable]
    config = engine if isinstance(engine, Path) else CONFIGS / f"{engine}.yaml"
    port = str(free_port())
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        port,
    ]


def kha_env(tmp_path: Path) -> dict:
    # no user accelerate config may leak in; DeepSpeed reads no GPU
    return {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_CONFIG_FILE": str(tmp_path / "none.yaml")}


def kha_train(args: list, engine: str | None, tmp_path: Path, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*launcher(engine), "-m", "kha_hf", "train", *map(str, args)],
        capture_output=True,
        text=True,
        env=kha_env(tmp_path),
        timeout=900,
    )
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def logged_losses(out: Path) -> dict[int, float]:
    """Step -> training loss, from the last checkpoint's trainer state (a resumed run's holds the whole history)."""
    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((last / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


def heldout_loss(model_dir: Path, corpus_dir: Path, seq_len: int = 64, global_batch: int = 4) -> float:
    """The mean loss of the saved model over the held-out blocks the run evaluated: at most 256, in whole global
    batches (the paper's arguments drop an incomplete batch, in evaluation too)."""
    from kha_hf import KHAForCausalLM

    model = KHAForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = open_corpus(corpus_dir).blocks("heldout", seq_len, 256)
    losses = []
    with torch.no_grad():
        for i in range(len(blocks) // global_batch * global_batch):
            ids = blocks[i]["input_ids"][None]
            losses.append(model(ids, labels=ids).loss.item())
    return sum(losses) / len(losses)

"""Axolotl driven in-process through its own API, on tiny local models: what `axolotl train` does, step by step.

`validate(cfg)`: `prepare_plugins` (the plugins' `register(cfg)`), then `validate_config` (the plugins' YAML keys
merged into Axolotl's config model), then `normalize_config`. `train(cfg)` adds Axolotl's dataset loading and
`axolotl.train.train`. Axolotl's `PluginManager` is a process-wide singleton that keeps every plugin registered in
the process: `clear_plugins()` empties it (the conftest does so around each test).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLUGIN = "kha_hf.integrations.axolotl.KHAPlugin"
TEXT = "the quick brown fox jumps over the lazy dog "


def clear_plugins() -> None:
    from axolotl.integrations.base import PluginManager

    manager = PluginManager.get_instance()  # the same object Axolotl's loaders hold (module-level references)
    manager.plugins.clear()
    manager.cfg = None


def write_data(path: Path, rows: int = 64) -> Path:
    """A local JSON-lines data set for Axolotl's `type: completion` (a `text` field)."""
    path.write_text("".join(json.dumps({"text": TEXT * 3}) + "\n" for _ in range(rows)))
    return path


def config(tmp_path: Path, base: Path, **overrides: Any) -> dict:
    """A tiny CPU run: float32 (bf16/fp16 off), no Triton LoRA kernels unless OVERRIDES say, one process."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_data(data)
    cfg = {
        "base_model": str(base),
        "plugins": [PLUGIN],
        "datasets": [{"path": str(data), "ds_type": "json", "type": "completion"}],
        "sequence_len": 32,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": 6,
        "learning_rate": 0.01,
        "optimizer": "adamw_torch",
        "lr_scheduler": "constant",
        "weight_decay": 0.0,
        "output_dir": str(tmp_path / "out"),
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "val_set_size": 0,
        "logging_steps": 1,
        "save_steps": 1000,
        "dataset_num_proc": 1,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    cfg.update(overrides)
    return {key: value for key, value in cfg.items() if value is not None}


def validate(cfg: dict):
    """Axolotl's config as `axolotl train` makes it: plugins registered first, then validated and normalised."""
    from axolotl.utils.config import normalize_config, prepare_plugins, validate_config
    from axolotl.utils.dict import DictDefault

    parsed = DictDefault(cfg)
    prepare_plugins(parsed)
    parsed = validate_config(parsed)
    normalize_config(parsed)
    return parsed


def train(cfg: dict):
    """(model, trainer, validated cfg) after Axolotl's own training loop on CFG."""
    import axolotl.train
    from axolotl.common.datasets import load_datasets
    from axolotl.integrations.base import PluginManager

    parsed = validate(cfg)
    PluginManager.get_instance().cfg = parsed
    model, _, trainer = axolotl.train.train(cfg=parsed, dataset_meta=load_datasets(cfg=parsed))
    return model, trainer, parsed


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def text_loss(model, folder: Path) -> float:
    """MODEL's loss on the training text (FOLDER's tokenizer, 32 tokens): lower after training than before, while
    the per-step losses Axolotl logs are on different chunks of it and go up and down."""
    import torch
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(TEXT * 3, return_tensors="pt").input_ids[:, :32]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    model.train(was_training)
    return loss

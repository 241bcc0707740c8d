"""Read a KHA checkpoint's config and knock tensors without building the model (memory: the knocks only)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..common.errors import KHAError
from ..modeling.configuration_kha import KHAConfig
from .knock_tensors import KNOCK_KEY
from .safetensors_index import TensorInfo, read_checkpoint_index
from .source import read_config


def read_kha_config(folder: Path) -> KHAConfig:
    config = read_config(folder)
    if config.get("model_type") != KHAConfig.model_type:
        raise KHAError(f"{folder} is not a KHA checkpoint (model_type {config.get('model_type')!r})")
    try:
        return KHAConfig(**{k: v for k, v in config.items() if k != "model_type"})
    except Exception as err:  # the family's config class rejects what it cannot use, in its own words
        raise KHAError(f"invalid {folder / 'config.json'}: {err}") from err


def knock_keys(tensors: dict[str, TensorInfo]) -> list[str]:
    return sorted(name for name in tensors if KNOCK_KEY.match(name))


def read_knocks(folder: Path, tensors: dict[str, TensorInfo] | None = None) -> dict[str, torch.Tensor]:
    """Every knock tensor of the checkpoint, by name, read one shard at a time."""
    tensors = tensors if tensors is not None else read_checkpoint_index(folder)
    by_file: dict[str, list[str]] = {}
    for name in knock_keys(tensors):
        by_file.setdefault(tensors[name].file, []).append(name)
    knocks = {}
    for file, names in by_file.items():
        with safe_open(folder / file, framework="pt") as f:
            for name in names:
                knocks[name] = f.get_tensor(name)
    return knocks

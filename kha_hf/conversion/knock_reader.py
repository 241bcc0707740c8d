"""Read a KHA checkpoint's config and knock tensors without building the model (memory: the knocks only)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..common.errors import KHAError
from ..common.safetensors_index import TensorInfo, read_checkpoint_index
from ..modeling.configuration_kha import KHAConfig
from .knock_tensors import KNOCK_KEY, knock_specs
from .source import read_config


def read_kha_config(folder: Path) -> KHAConfig:
    config = read_config(folder)
    if config.get("model_type") != KHAConfig.model_type:
        raise KHAError(f"{folder} is not a KHA checkpoint (model_type {config.get('model_type')!r})")
    from ..common.checks import check_config_numbers

    check_config_numbers(config, str(folder / "config.json"))  # hostile values: one line, not a traceback
    try:
        return KHAConfig(**{k: v for k, v in config.items() if k != "model_type"})
    except Exception as err:  # the family's config class rejects what it cannot use, in its own words
        raise KHAError(f"invalid {folder / 'config.json'}: {err}") from err


def knock_keys(tensors: dict[str, TensorInfo]) -> list[str]:
    return sorted(name for name in tensors if KNOCK_KEY.match(name))


def check_knock_tensors(config: KHAConfig, tensors: dict[str, TensorInfo], prefix: str, folder: Path) -> None:
    """The checkpoint holds exactly the knock tensors its config describes, each a d_h x d_h matrix."""
    expected = knock_specs(config, prefix)
    found = set(knock_keys(tensors))
    missing = sorted(set(expected) - found)
    if missing:
        raise KHAError(f"{folder}: knock tensor {missing[0]} is missing ({len(missing)} missing in all)")
    extra = sorted(found - set(expected))
    if extra:
        raise KHAError(
            f"{folder}: knock tensor {extra[0]} is not described by config.json (knocks {config.knock_q}/"
            f"{config.knock_k}/{config.knock_v} on layers {_layers(config)}); {len(extra)} such tensors"
        )
    for name in sorted(found):
        d = expected[name][1]
        if not tensors[name].dtype.is_floating_point:
            raise KHAError(f"{folder}: knock tensor {name} is {tensors[name].dtype}, not a floating-point tensor")
        if tensors[name].shape != (d, d):
            raise KHAError(f"{folder}: knock tensor {name} has shape {list(tensors[name].shape)}, expected [{d}, {d}]")


def _layers(config: KHAConfig) -> str:
    layers = config.knocked_layers
    return f"0..{layers[-1]}" if layers == list(range(len(layers))) else ",".join(map(str, layers))


def check_finite(knocks: dict[str, torch.Tensor], folder: Path) -> None:
    """NaN or infinite knock values would spread into every weight they are folded into."""
    for name, tensor in knocks.items():
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise KHAError(f"{folder}: knock tensor {name} holds {bad} NaN or infinite values; refusing to use it")


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

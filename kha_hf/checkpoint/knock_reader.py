"""A KHA checkpoint opened once and checked, without building the model (memory: the knocks only).

`open_kha_checkpoint` takes the folder's `Checkpoint` (config dict and tensor headers, read once by
`checkpoint.reader.open_checkpoint`) and checks what every tool that reads knocks needs: a KHA config whose values
are sane, a text decoder whose layers the family layout finds, and exactly the knock tensors that config describes,
each d_h x d_h floating point. `kha fold`, `kha fold OUT.gguf`, `kha inspect` and `kha adapter` take that value;
`KHACheckpoint.read_knocks` reads the knock values, one shard at a time, and refuses NaN or infinite ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoint.checks import check_config_numbers
from ..checkpoint.reader import Checkpoint, open_checkpoint
from ..checkpoint.safetensors_index import TensorInfo
from ..common.errors import KHAError
from ..modeling.configuration_kha import KHAConfig
from ..modeling.knocks import finite_mask
from .knock_tensors import KNOCK_KEY, knock_specs, layer_prefix


@dataclass(frozen=True)
class KHACheckpoint:
    """A KHA checkpoint folder as `open_kha_checkpoint` read and checked it."""

    checkpoint: Checkpoint  # the folder, its config.json and its tensor headers
    config: KHAConfig  # built from config.json, its values checked
    prefix: str  # the text decoder's `...layers.` prefix (`model.`, `model.language_model.`, ...)
    knock_names: tuple[str, ...]  # every knock tensor, sorted: exactly those the config describes

    @property
    def folder(self) -> Path:
        return self.checkpoint.folder

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.checkpoint.tensors

    def read_knocks(self) -> dict[str, torch.Tensor]:
        """Every knock tensor, by name, read one shard at a time; NaN or infinite values refused, and so is a knock
        that is no longer what the checked header said (a shard replaced or removed since the folder was opened:
        each read, e.g. `kha inspect --plot`'s table and then its plot, reads the files again)."""
        by_file: dict[str, list[str]] = {}
        for name in self.knock_names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        knocks = {}
        for file, names in by_file.items():
            path = self.folder / file
            try:
                with safe_open(path, framework="pt") as f:
                    for name in names:
                        knocks[name] = f.get_tensor(name)
            except (OSError, SafetensorError) as err:  # safetensors' error is no OSError
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise KHAError(f"{path} cannot be read since the folder was checked ({reason}); run again") from None
            for name in names:
                info, tensor = self.tensors[name], knocks[name]
                if tensor.dtype != info.dtype or tuple(tensor.shape) != tuple(info.shape):
                    raise KHAError(
                        f"{path}: knock tensor {name} is now {tensor.dtype} {list(tensor.shape)}, not the checked "
                        f"{info.dtype} {list(info.shape)}: the file changed since the folder was opened; run again"
                    )
        check_finite(knocks, self.folder)
        return knocks


def open_kha_checkpoint(source: str | Path | Checkpoint) -> KHACheckpoint:
    """SOURCE (a folder, or its `Checkpoint` already open) as a checked KHA checkpoint; one-line KHAError for a
    folder that is not one, a config whose values are hostile or that the family rejects, and knock tensors that
    do not fit the config."""
    if isinstance(source, Checkpoint) and source.config is not None:
        checkpoint = source
    else:  # a folder, or a checkpoint opened without its config: refused in `read_config`'s words
        checkpoint = open_checkpoint(source.folder if isinstance(source, Checkpoint) else source, required=True)
    folder = checkpoint.folder
    config = kha_config(checkpoint)
    tensors = checkpoint.weights()
    try:
        prefix = layer_prefix(tensors, config)
    except ValueError as err:
        raise KHAError(f"{folder}: {err}") from err
    check_knock_tensors(config, tensors, prefix, folder)
    return KHACheckpoint(checkpoint, config, prefix, tuple(knock_keys(tensors)))


def kha_config(checkpoint: Checkpoint) -> KHAConfig:
    """CHECKPOINT's config.json as a KHAConfig, its values checked first."""
    folder, config = checkpoint.folder, checkpoint.config or {}
    if config.get("model_type") != KHAConfig.model_type:
        raise KHAError(f"{folder} is not a KHA checkpoint (model_type {config.get('model_type')!r})")
    check_config_numbers(config, checkpoint.where)  # hostile values: one line, not a traceback
    try:
        return KHAConfig(**{k: v for k, v in config.items() if k != "model_type"})
    except Exception as err:  # the family's config class rejects what it cannot use, in its own words
        raise KHAError(f"invalid {checkpoint.where}: {err}") from err


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
        finite = finite_mask(tensor)
        if not finite.all():
            bad = int((~finite).sum())
            raise KHAError(f"{folder}: knock tensor {name} holds {bad} NaN or infinite values; refusing to use it")

"""A KHA checkpoint opened once and checked, without building the model (memory: the knocks only).

`open_kha_checkpoint` opens the folder as `reader.open_checkpoint` opens any, taking KHA configs only: it has
checked the config's values, that the family layout finds the text decoder's layers, that the weights are those the
config describes, and that the knock tensors are exactly those the config describes, each d_h x d_h floating point.
`kha fold`, `kha fold OUT.gguf`, `kha inspect`, `kha verify`, `kha adapter` and the Axolotl plugin take that value;
`KHACheckpoint.read_knocks` reads the knock values, one shard at a time, and refuses NaN or infinite ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..common.errors import KHAError
from ..modeling.configuration_kha import KHAConfig
from ..modeling.knocks import finite_mask
from .checks import knock_keys
from .reader import Checkpoint, open_checkpoint
from .safetensors_index import TensorInfo


class NotAKHACheckpoint(KHAError):
    """A folder whose config.json is not a KHA config (a tool may word that refusal its own way)."""


@dataclass(frozen=True)
class KHACheckpoint:
    """A KHA checkpoint folder as `open_kha_checkpoint` read and checked it."""

    checkpoint: Checkpoint  # the folder, its config.json and its tensor headers
    config: KHAConfig  # built from config.json, its values checked
    prefix: str  # the text decoder's `...layers.` prefix (`model.`, `model.language_model.`, ...)
    knock_names: tuple[str, ...]  # every knock tensor, sorted: exactly those the config describes

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> KHACheckpoint:
        """CHECKPOINT (opened with `is_kha` and `kha_config`, as `open_kha_checkpoint` opens it) with its knocks."""
        names = tuple(knock_keys(checkpoint.tensors))
        return cls(checkpoint, checkpoint.model_config, checkpoint.prefix, names)

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


def open_kha_checkpoint(folder: str | Path, causal_lm: bool = False) -> KHACheckpoint:
    """FOLDER read and checked as a KHA checkpoint; one-line KHAError for a folder that is not one, a config whose
    values are hostile or that the family rejects, weights the config does not describe and knock tensors that do
    not fit the config (`open_checkpoint`'s rules). CAUSAL_LM: a task head is refused."""
    return KHACheckpoint.of(open_checkpoint(folder, True, accept=is_kha, build=kha_config, causal_lm=causal_lm))


def is_kha(config: dict, folder: Path) -> None:
    """`open_checkpoint`'s ACCEPT for a tool that reads knocks: a KHA config."""
    if config.get("model_type") != KHAConfig.model_type:
        raise NotAKHACheckpoint(f"{folder} is not a KHA checkpoint (model_type {config.get('model_type')!r})")


def kha_config(config: dict, folder: Path) -> KHAConfig:
    """`open_checkpoint`'s BUILD for a KHA checkpoint: one-line KHAError for values the family rejects."""
    try:
        return KHAConfig(**{k: v for k, v in config.items() if k != "model_type"})
    except Exception as err:  # the family's config class rejects what it cannot use, in its own words
        raise KHAError(f"invalid {folder / 'config.json'}: {err}") from err


def check_finite(knocks: dict[str, torch.Tensor], folder: Path) -> None:
    """NaN or infinite knock values would spread into every weight they are folded into."""
    for name, tensor in knocks.items():
        finite = finite_mask(tensor)
        if not finite.all():
            bad = int((~finite).sum())
            raise KHAError(f"{folder}: knock tensor {name} holds {bad} NaN or infinite values; refusing to use it")

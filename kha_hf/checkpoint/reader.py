"""A checkpoint folder opened once, and checked as it is opened: its config.json and its safetensors headers.

Every tool that takes a local checkpoint folder opens it here. `open_checkpoint` parses config.json (`_parse_config`,
the one parser of that file), reads every shard's header (`read_checkpoint_index`, never the tensor data), applies
the rules of `checks.py` (which read no file) and hands back a `Checkpoint`: a value that has been checked, so the
tool that holds one checks nothing again. Its config's numbers are checked before any header is read, so an absurd
config costs no header read. What a tool asks beyond that (a causal LM, not a task head; no code shipped inside the
model; its own rule on the config, such as `kha convert`'s "a base model of a supported family") it says when it
opens the folder. A KHA checkpoint's knocks are read on top of this value (`knock_reader.open_kha_checkpoint`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import KHAError
from ..modeling.configuration_kha import multimodal_text_type
from .checks import (
    check_config,
    check_weights,
    family_type,
    refuse_task_head,
    task_head,
)
from .safetensors_index import INDEX_FILE, SINGLE_FILE, TensorInfo, no_weights, read_checkpoint_index

CONFIG_FILE = "config.json"


class NoConfig(KHAError):
    """A folder without a readable config.json: not a transformers checkpoint (a tool may word that its own way)."""


def _parse_config(folder: Path) -> dict | str:
    """FOLDER's config.json as a dict, or the one line that says why there is none."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return f"{folder} has no config.json: not a transformers checkpoint folder"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        return f"{path} is not valid JSON: {err}"
    except OSError as err:
        return f"{path} cannot be read: {err}"
    except RecursionError:  # JSON nested thousands deep: no config, and no traceback either
        raise KHAError(f"{path} nests too deeply to be a model config") from None
    if not isinstance(config, dict):
        return f"{path} must hold a JSON object, not {type(config).__name__}"
    return config


def read_config(folder: Path) -> dict:
    """FOLDER's config.json as a dict; one-line KHAError when it is missing, not JSON or not a JSON object."""
    config = _parse_config(folder)
    if isinstance(config, str):
        raise KHAError(config)
    return config


def read_config_dict(folder: Path) -> dict | None:
    """FOLDER's config.json as a dict, or None if there is none or it is not a JSON object (a Hub id's folder, a
    GGUF file's folder: the caller decides whether that is an error)."""
    config = _parse_config(folder)
    return None if isinstance(config, str) else config


def has_weights(folder: Path) -> bool:
    """True when FOLDER holds safetensors weights (a single file or a shard index)."""
    return (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()


@dataclass(frozen=True)
class Checkpoint:
    """A local checkpoint folder as `open_checkpoint` read and checked it (nothing of the tensor data)."""

    folder: Path
    config: dict  # config.json
    tensors: dict[str, TensorInfo]  # name -> shard, dtype, shape, from every shard's header; {} without weights
    model_config: object = None  # the config object built from it (a KHAConfig, a family's config); None if unbuilt
    shapes: dict | None = None  # name -> shape of every tensor the causal LM it describes holds (`model_tensor_shapes`)
    prefix: str | None = None  # the text decoder's `...layers.` prefix, where the tool built a KHAConfig
    base_config: object = None  # the stock config of the causal LM it describes (a KHA config's `to_base_config()`)

    @property
    def where(self) -> str:
        """config.json's path, as refusals name it."""
        return str(self.folder / CONFIG_FILE)

    @property
    def is_kha(self) -> bool:
        return self.config.get("model_type") == "kha"

    @property
    def model_type(self):
        """The family's model_type: `base_model_type` for a KHA checkpoint (may be anything JSON holds)."""
        return family_type(self.config)

    @property
    def is_multimodal(self) -> bool:
        """A multimodal model around a text decoder (stock or KHA): gemma3, qwen2_5_vl, ..."""
        return multimodal_text_type(self.model_type) is not None

    def weights(self) -> dict[str, TensorInfo]:
        """`tensors`, for a tool that needs weights: one-line KHAError when the folder holds none."""
        if not self.tensors:
            raise no_weights(self.folder)
        return self.tensors

    def task_head(self) -> str | None:
        """What makes this checkpoint a task head rather than a language model: the head architecture its config
        names (`Qwen3ForSequenceClassification`, `KHAForTokenClassification`, ...), or, when the config names none,
        a head tensor in its weights (`score.weight`); None for a causal LM."""
        return task_head(self.config, self.tensors, self.where)

    def check_not_task_head(self) -> None:
        """For a tool that learns only later that it needs a causal LM (`open_checkpoint`'s CAUSAL_LM otherwise)."""
        refuse_task_head(self.folder, self.task_head())


def open_checkpoint(
    folder: str | Path,
    required: bool = False,
    accept=None,
    build=None,
    trust_remote_code: bool | None = None,
    causal_lm: bool | str = False,
) -> Checkpoint:
    """FOLDER read and checked: one-line KHAError when config.json cannot describe the safetensors weights (its
    numbers, the layer count, vocabulary, head, attention layout, every tensor's shape and floating dtype: a
    multimodal model's every parameter, a decoder's every tensor the model has).

    REQUIRED (the conversion tools): a missing or unreadable config.json is refused in `read_config`'s words (else
    as "no readable config.json"), and so is a folder without safetensors weights.
    ACCEPT(config, folder): the tool's own rule on the parsed config (the model types it takes), run first.
    BUILD(config, folder): the config object the tool builds from it once its numbers are checked (then used here),
    in the tool's words where the family's class rejects it. No header is read before.
    TRUST_REMOTE_CODE (a tool that loads the model): a folder that ships its own code is refused unless True.
    CAUSAL_LM: a task head (reward model, classifier) is refused: loaded as a causal LM it gets a random lm_head (a
    string: why, in the tool's words)."""
    folder = Path(folder)
    config = _parse_config(folder)
    if isinstance(config, str):
        raise NoConfig(
            config if required else f"{folder} has no readable config.json: not a transformers checkpoint folder"
        )
    if accept is not None:
        accept(config, folder)
    check_config(config, folder, trust_remote_code)
    built = build(config, folder) if build is not None else None
    tensors = read_checkpoint_index(folder) if required or has_weights(folder) else {}
    return Checkpoint(folder, config, tensors, *check_weights(folder, config, tensors, built, causal_lm))


def check_not_task_head(folder: Path) -> None:
    """FOLDER (a tool that loads it later, by its own path) is no task head: its config.json and headers only."""
    tensors = read_checkpoint_index(folder) if has_weights(folder) else {}
    refuse_task_head(folder, task_head(read_config_dict(folder) or {}, tensors, str(folder / CONFIG_FILE)))

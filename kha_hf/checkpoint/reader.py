"""A checkpoint folder opened once: its config.json and its safetensors headers, read as one value.

Every tool that takes a local checkpoint folder reads it here: `open_checkpoint` parses config.json (`read_config`,
the one parser of that file) and hands back a `Checkpoint`, whose `tensors` are every shard's header
(`read_checkpoint_index`, never the tensor data), read when first asked for and then kept: a config that is refused
never costs a header read, and no header is read twice. What is checked of it is checked on that value
(`Checkpoint.check`, `Checkpoint.task_head`), by the rules of `checks.py`, which reads no file itself. A KHA
checkpoint's knocks are read on top of this value (`checkpoint.knock_reader.KHACheckpoint`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..common.errors import KHAError
from ..modeling.configuration_kha import KHAConfig, base_config_class, multimodal_text_type
from ..modeling.families import FAMILIES
from .checks import (
    HEAD_SUFFIXES,
    HEAD_TENSORS,
    architectures_of,
    check_attention_layout,
    check_config_numbers,
    check_head_weights,
    check_multimodal_weights,
    check_tensor_shapes,
    check_tied_output,
    check_weights_match_config,
    kha_head_name,
    model_tensor_shapes,
)
from .safetensors_index import INDEX_FILE, SINGLE_FILE, TensorInfo, read_checkpoint_index

CONFIG_FILE = "config.json"


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


def family_type(config: dict):
    """The family's model_type of CONFIG (a config.json dict): `base_model_type` for a KHA checkpoint."""
    return config.get("base_model_type") if config.get("model_type") == "kha" else config.get("model_type")


def has_weights(folder: Path) -> bool:
    """True when FOLDER holds safetensors weights (a single file or a shard index)."""
    return (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()


@dataclass(frozen=True)
class Checkpoint:
    """A local checkpoint folder as read once by `open_checkpoint` (nothing of the tensor data)."""

    folder: Path
    config: dict | None  # config.json; None when it is missing or unreadable (`check` refuses such a folder)

    @cached_property
    def has_weights(self) -> bool:
        """model.safetensors or model.safetensors.index.json is there."""
        return has_weights(self.folder)

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Tensor name -> shard, dtype, shape, from the headers (checked as `read_header` checks them); {} when the
        folder holds no weights. Read on first use, once."""
        return read_checkpoint_index(self.folder) if self.has_weights else {}

    @property
    def where(self) -> str:
        """config.json's path, as refusals name it."""
        return str(self.folder / CONFIG_FILE)

    @property
    def is_kha(self) -> bool:
        return (self.config or {}).get("model_type") == "kha"

    @property
    def model_type(self):
        """The family's model_type: `base_model_type` for a KHA checkpoint (may be anything JSON holds)."""
        return family_type(self.config or {})

    @property
    def is_multimodal(self) -> bool:
        """A multimodal model around a text decoder (stock or KHA): gemma3, qwen2_5_vl, ..."""
        return multimodal_text_type(self.model_type) is not None

    def weights(self) -> dict[str, TensorInfo]:
        """`tensors`, for a tool that needs weights: one-line KHAError (`read_checkpoint_index`'s) when the folder
        holds none."""
        return self.tensors if self.has_weights else read_checkpoint_index(self.folder)

    def task_head(self) -> str | None:
        """What makes this checkpoint a task head rather than a language model: the head architecture its config
        names (`Qwen3ForSequenceClassification`, `KHAForTokenClassification`, ...), or, when the config names none,
        a head tensor in its weights (`score.weight`); None for a causal LM."""
        named = next((n for n in architectures_of(self.config or {}, self.where) if n.endswith(HEAD_SUFFIXES)), None)
        if named is not None:
            return named
        found = next((name for name in HEAD_TENSORS if name in self.tensors), None)
        if found is not None and "lm_head.weight" not in self.tensors:
            return f"task-head checkpoint (its weights hold {found} and no lm_head)"
        return None

    def check_not_task_head(self) -> None:
        """A reward model or classifier loaded as a causal LM would get a new, random LM head: refuse in one line."""
        head = self.task_head()
        if head is not None:
            raise KHAError(
                f"{self.folder} is a {head}, not a language model: this command needs a causal LM; load it with its "
                "own Auto class (e.g. AutoModelForSequenceClassification)"
            )

    def check(self) -> None:
        """One-line KHAError when config.json cannot describe the safetensors weights (`checks.py`'s rules: its
        numbers, the layer count, vocabulary, head, attention layout, every tensor's shape and floating dtype: a
        multimodal model's every parameter, a decoder's every tensor the model has)."""
        config, where = self.config, self.where
        if config is None:
            raise KHAError(f"{self.folder} has no readable config.json: not a transformers checkpoint folder")
        check_config_numbers(config, where)
        if not self.has_weights:
            return
        tensors = self.tensors
        check_weights_match_config(config, tensors, where)
        head = next((name for name in architectures_of(config, where) if name.endswith(HEAD_SUFFIXES)), None)
        check_head_weights(config, kha_head_name(head) if head else "KHAForCausalLM", tensors, where)
        model_type = self.model_type
        if model_type not in FAMILIES and not self.is_multimodal:
            return  # another architecture: transformers (or its remote code) checks its own
        fields = {k: v for k, v in config.items() if k != "model_type"}
        try:
            built = KHAConfig(**fields) if self.is_kha else base_config_class(model_type)(**fields)
        except Exception as err:  # the family's config class rejects what it cannot use, in its own words
            raise KHAError(f"{where}: {str(err).strip().splitlines()[0]}") from err
        if self.is_multimodal:
            check_multimodal_weights(built, tensors, where)
        else:
            check_attention_layout(built, tensors, where)
            base = built.to_base_config() if self.is_kha else built
            check_tensor_shapes(model_tensor_shapes(base, where), tensors, where)
            check_tied_output(base, tensors, self.folder, where)


def open_checkpoint(folder: str | Path, required: bool = False) -> Checkpoint:
    """FOLDER as a `Checkpoint`: its config.json parsed now, its safetensors headers when first used.
    REQUIRED (the conversion tools): a missing or unreadable config.json is refused here, in `read_config`'s words
    (they then take the headers through `Checkpoint.weights`, which refuses a folder without weights); otherwise
    the value's config is None (`Checkpoint.check` refuses such a folder)."""
    folder = Path(folder)
    return Checkpoint(folder, read_config(folder) if required else read_config_dict(folder))


def check_not_task_head(folder: Path) -> None:
    """`Checkpoint.check_not_task_head` of FOLDER (a tool that loads it later, by its own path)."""
    open_checkpoint(folder).check_not_task_head()

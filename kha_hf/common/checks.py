"""A checkpoint's config.json against its weights, read from safetensors headers before any model is built.

transformers builds the model its config describes and then fills it from the weight files: a config that claims
three layers over two-layer weights gets a randomly initialised third layer (a warning in a long log), one that
claims 10^9 layers allocates until the machine runs out of memory, and head counts of 0 or a dtype named
"float128" end in tracebacks. The tools check first and answer in one line.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..modeling.configuration_kha import KHAConfig, base_config_class
from ..modeling.families import FAMILIES, family_spec, projection_features
from .errors import KHAError
from .loading import read_config_dict
from .safetensors_index import INDEX_FILE, SINGLE_FILE, TensorInfo, read_checkpoint_index

# Architecture sizes that must be positive integers wherever a config has them.
SIZE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)
_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")
_PROJECTION = re.compile(r"^(?:.*\.)?layers\.\d+\.self_attn\.(\w+)\.weight$")


def check_config_numbers(config: dict, where: str) -> None:
    """Sizes are positive integers; the dtype names a torch floating dtype (or 'auto')."""
    for name in SIZE_FIELDS:
        value = config.get(name)
        if name in config and value is not None and (type(value) is not int or value <= 0):
            raise KHAError(f"{where}: {name} must be a positive integer, got {value!r}")
    for name in ("dtype", "torch_dtype"):
        value = config.get(name)
        if isinstance(value, str) and value != "auto":
            dtype = getattr(torch, value.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise KHAError(f"{where}: {name} {value!r} is not a torch floating-point dtype")


def check_weights_match_config(config: dict, tensors: dict[str, TensorInfo], where: str) -> None:
    """The decoder layers the config names exist in the weights, and the embedding matches the vocabulary."""
    layers = config.get("num_hidden_layers")
    found = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name)) and "vision" not in name}
    if isinstance(layers, int) and found:
        within = sum(1 for i in found if i < layers)  # never builds range(layers): it may be absurdly large
        missing, extra = layers - within, len(found) - within
        allowed_extra = config.get("num_nextn_predict_layers") or 0  # DeepSeek-V3's multi-token-prediction layers
        if missing or extra > allowed_extra:
            raise KHAError(
                f"{where}: config.json says {layers} layers, the weights hold {len(found)} "
                f"(layer indices {min(found)}..{max(found)})"
            )
    vocab = config.get("vocab_size")
    embedding = next((info for name, info in tensors.items() if name.endswith("embed_tokens.weight")), None)
    if isinstance(vocab, int) and embedding is not None and embedding.shape[0] != vocab:
        raise KHAError(f"{where}: config.json says vocab_size {vocab}, the embedding has {embedding.shape[0]} rows")
    hidden = config.get("hidden_size")
    if isinstance(hidden, int) and embedding is not None and len(embedding.shape) == 2:
        if embedding.shape[1] != hidden:
            width = embedding.shape[1]
            raise KHAError(f"{where}: config.json says hidden_size {hidden}, the embedding is {width} wide")


def check_attention_layout(config, tensors: dict[str, TensorInfo], where: str) -> None:
    """Every attention projection in the weights has the output size the family's KHA layout gives it (CONFIG: a
    KHA or base config object): the knocks split those outputs into heads, so a mismatch must stop here."""
    model_type = config.base_model_type if config.model_type == "kha" else config.model_type
    layout = family_spec(model_type).layout
    for name, info in tensors.items():
        match = _PROJECTION.match(name)
        if match and match.group(1) in layout:
            expected = projection_features(config, layout[match.group(1)])
            if info.shape[:1] != (expected,):
                raise KHAError(
                    f"{where}: {name} has shape {list(info.shape)}; the config's head counts and sizes give "
                    f"{expected} output features"
                )


def check_checkpoint_against_config(folder: Path) -> None:
    """One-line KHAError when FOLDER's config.json cannot describe its safetensors weights."""
    config = read_config_dict(folder)
    if config is None:
        raise KHAError(f"{folder} has no readable config.json: not a transformers checkpoint folder")
    where = str(folder / "config.json")
    check_config_numbers(config, where)
    if not ((folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()):
        return
    tensors = read_checkpoint_index(folder)
    check_weights_match_config(config, tensors, where)
    is_kha = config.get("model_type") == "kha"
    model_type = config.get("base_model_type") if is_kha else config.get("model_type")
    if model_type not in FAMILIES:
        return  # another architecture: transformers (or its remote code) checks its own
    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        built = KHAConfig(**fields) if is_kha else base_config_class(model_type)(**fields)
    except Exception as err:  # the family's config class rejects what it cannot use, in its own words
        raise KHAError(f"{where}: {str(err).strip().splitlines()[0]}") from err
    check_attention_layout(built, tensors, where)

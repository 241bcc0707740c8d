"""`kha train` from a config, not a checkpoint: a preset name, a config.json, or a folder holding only a config.

A base family's config becomes a KHA config with `--knock`; a KHA config keeps its own knocks. The model is built
with fresh weights from the seed (knocks at the identity, as in every KHA init), with the vocabulary of the
tokenizer it will train with.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.checks import check_config_numbers
from ..checkpoint.reader import read_config
from ..common.errors import KHAError
from ..modeling.configuration_kha import KHAConfig
from .presets import PRESETS

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def is_config_ref(ref: str | Path) -> bool:
    """A preset name, a .json file, or a folder with a config.json and no weights. A name that is both a preset and
    a path here is refused: which one was meant cannot be told."""
    if str(ref) in PRESETS:
        if Path(ref).exists() or Path(ref).is_symlink():
            raise KHAError(f"{ref} is a preset and also a path here: write ./{ref} for the path, or run elsewhere")
        return True
    path = Path(ref).expanduser()
    if path.is_file():
        return path.suffix == ".json"
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS)
    )


def kha_config_from(ref: str | Path, knock: str | None, vocab_size: int) -> KHAConfig:
    """The KHA config REF describes, its vocabulary set to VOCAB_SIZE (the tokenizer's)."""
    from transformers import AutoConfig

    if str(ref) in PRESETS:
        base = PRESETS[str(ref)].config()
    else:
        path = Path(ref).expanduser()
        values = _config_values(path)
        check_config_numbers(values, str(path))  # hostile sizes (10^9 layers) are refused before anything is built
        try:
            base = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise KHAError(f"cannot read a model config from {path}: {' '.join(str(err).split())}") from err
    try:
        if isinstance(base, KHAConfig):
            if knock is not None:
                raise KHAError(f"{ref} is a KHA config with its own knocks; --knock applies to a base family's config")
            config = base
        else:
            config = KHAConfig.from_base(base, knock=knock or "mlp_v")
    except ValueError as err:
        raise KHAError(str(err)) from err
    config.vocab_size = vocab_size
    return config


def _config_values(path: Path) -> dict:
    """The values of the config PATH names: a folder's config.json, or a JSON file of another name, read as
    config.json would be, with the same one-line refusals."""
    if path.is_dir() or path.name == "config.json":
        return read_config(path if path.is_dir() else path.parent)
    return _read_json_config(path)


def _read_json_config(path: Path) -> dict:
    import json

    if path.stat().st_size > 16 << 20:
        raise KHAError(f"{path} is larger than 16 MiB: not a model config")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise KHAError(f"{path} is not a JSON model config: {err}") from err
    if not isinstance(values, dict):
        raise KHAError(f"{path} is not a JSON object")
    return values


def check_model_fits(config: KHAConfig, dtype) -> int:
    """Count CONFIG's parameters on the meta device (nothing allocated) and refuse a model whose weights alone
    would not fit in the memory free now (training needs about four times that: gradients, AdamW's two states).
    Returns the weights' bytes."""

    from .corpus_data import available_memory

    weights = weight_bytes(config, dtype)
    free = available_memory()
    if free is not None and weights > free:
        raise KHAError(
            f"the config's model holds {weights / 2**30:.1f} GiB of weights, more than the {free / 2**30:.1f} GiB free "
            "(training needs about four times its weights)"
        )
    return weights


def weight_bytes(model_or_config, dtype=None) -> int:
    """The bytes of a model's weights: of MODEL_OR_CONFIG itself, or of the model a config builds (counted on the
    meta device: nothing allocated)."""
    import torch
    from torch import nn

    from ..modeling.modeling_kha import KHAForCausalLM

    model = model_or_config
    if not isinstance(model_or_config, nn.Module):
        try:
            with torch.device("meta"):
                model = KHAForCausalLM._from_config(model_or_config, dtype=dtype)
        except (ValueError, TypeError, RuntimeError) as err:
            raise KHAError(f"cannot build a model of this config: {' '.join(str(err).split())[:300]}") from err
    return sum(p.numel() * p.element_size() for p in model.parameters())


def model_from_config(config: KHAConfig, seed: int, dtype):
    """A freshly initialised KHA model of CONFIG (seeded: every rank of a run builds the same weights)."""
    import torch

    from ..modeling.modeling_kha import KHAForCausalLM

    torch.manual_seed(seed)
    return KHAForCausalLM._from_config(config, dtype=dtype)


def pretraining_lr(ref: str | Path, config) -> tuple[float, str]:
    """(peak learning rate, where it comes from) for new weights trained with --mode full and no --lr: a preset's
    own rate, or for a config the rate of the preset nearest to it in width (the fine-tuning default of a
    checkpoint, 5e-5, barely moves new weights: 10.85 -> 10.22 in 40 steps on cpu-tiny)."""
    if str(ref) in PRESETS:
        return PRESETS[str(ref)].lr, f"the {ref} preset's"
    hidden = getattr(config.get_text_config(), "hidden_size", None) or 0
    name = min(PRESETS, key=lambda n: (abs(PRESETS[n].hidden_size - hidden), list(PRESETS).index(n)))
    return PRESETS[name].lr, f"the {name} preset's, the preset nearest this config's width ({hidden})"


def stated_vocab_size(ref: str | Path) -> int | None:
    """The vocabulary size REF (a preset or a config) states, before the tokenizer's replaces it; None if unread."""
    if str(ref) in PRESETS:
        return PRESETS[str(ref)].vocab_size
    try:
        values = _config_values(Path(ref).expanduser())
    except (KHAError, OSError):
        return None
    text = values.get("text_config") if isinstance(values.get("text_config"), dict) else values
    size = text.get("vocab_size")
    return size if type(size) is int else None

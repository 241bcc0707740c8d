"""Knock tensor names and their initial values, from one per-layer template; projection names from the family layout.

Keys sit next to the projections they follow, e.g. `model.layers.3.self_attn.v_knock.up.weight`, so a KHA
checkpoint is its base checkpoint plus these tensors.
"""

from __future__ import annotations

import re

import torch

from ..modeling.configuration_kha import KHAConfig
from ..modeling.families import family_spec

# knock type -> (parameter path inside the knock module, initial value)
KNOCK_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "linear": (("weight", "identity"),),
    "mlp": (("up.weight", "identity"), ("gate.weight", "zeros"), ("down.weight", "identity")),
    "gate": (("gate.weight", "zeros"),),
}
TARGETS = ("q", "k", "v")
KNOCK_KEY = re.compile(r"^(?P<prefix>.*)layers\.(?P<layer>\d+)\.self_attn\.(?P<target>[qkv])_knock\.(?P<part>.+)$")
_PROJECTION_KEY = re.compile(r"^(?P<prefix>.*)layers\.\d+\.self_attn\.(?P<projection>\w+)\.weight$")


def knock_key(prefix: str, layer: int, target: str, part: str) -> str:
    """The one template for knock tensor names."""
    return f"{prefix}layers.{layer}.self_attn.{target}_knock.{part}"


def projection_key(prefix: str, layer: int, projection: str, part: str = "weight") -> str:
    """The tensor name of a projection, e.g. `model.layers.0.self_attn.qkv_proj.weight`."""
    return f"{prefix}layers.{layer}.self_attn.{projection}.{part}"


def layer_prefix(tensor_names, config: KHAConfig) -> str:
    """The prefix in front of the text decoder's `layers.` in a checkpoint of CONFIG's model: `model.` for
    ...ForCausalLM checkpoints, `model.language_model.` (Gemma 3, Qwen2.5-VL), `model.text_model.` (SmolVLM),
    `language_model.model.` (Llama 4, and Hub checkpoints of the older multimodal layout)."""
    model_type = config.knock_config.base_model_type
    projections = set(family_spec(model_type).layout)
    prefixes: list[str] = []
    for name in tensor_names:
        match = _PROJECTION_KEY.match(name)
        if match and match.group("projection") in projections and match.group("prefix") not in prefixes:
            prefixes.append(match.group("prefix"))
    if not prefixes:
        raise ValueError(
            f"no `layers.N.self_attn.{{{', '.join(sorted(projections))}}}.weight` tensor: the weights do not follow "
            f"the {model_type} attention layout"
        )
    if not config.is_multimodal:
        return prefixes[0]
    # A vision tower may name its attention as the text decoder does (SigLIP, Pixtral). The text decoder's prefix
    # is made of these names only (model.language_model., language_model.model., model.text_model., Qwen2.5-VL's
    # model.); a tower's names the tower (vision_tower., visual., ...). It is required even when it is the only
    # prefix found: a checkpoint whose text layers are missing must not get its knocks in the vision tower.
    text = [p for p in prefixes if set(p.rstrip(".").split(".")) <= {"model", "language_model", "text_model"}]
    if len(text) != 1:
        found = ", ".join(prefixes)
        raise ValueError(f"cannot tell which of these layer stacks is the text decoder's: {found}")
    return text[0]


def knock_specs(config: KHAConfig, prefix: str = "model.") -> dict[str, tuple[str, int]]:
    """Knock tensor name -> (initial value 'identity' or 'zeros', matrix size), for every knocked layer."""
    dims = config.knock_dims
    specs: dict[str, tuple[str, int]] = {}
    for layer in config.knocked_layers:
        for target in TARGETS:
            kind = getattr(config, f"knock_{target}")
            for part, start in KNOCK_PARTS.get(kind, ()):
                specs[knock_key(prefix, layer, target, part)] = (start, dims[target])
    return specs


def initial_knock_tensors(config: KHAConfig, dtype: torch.dtype, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The knock tensors of a freshly converted model: exact identities (and zeros for MLP gates)."""
    make = {"identity": torch.eye, "zeros": lambda d, dtype: torch.zeros(d, d, dtype=dtype)}
    return {name: make[start](d, dtype=dtype) for name, (start, d) in knock_specs(config, prefix).items()}

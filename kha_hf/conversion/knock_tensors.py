"""Knock tensor names and their initial values, from one per-layer template.

Keys sit next to the projections they follow, e.g. `model.layers.3.self_attn.v_knock.up.weight`, so a KHA
checkpoint is its base checkpoint plus these tensors.
"""

from __future__ import annotations

import re

import torch

from ..modeling.configuration_kha import KHAConfig

# knock type -> (parameter path inside the knock module, initial value)
KNOCK_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "linear": (("weight", "identity"),),
    "mlp": (("up.weight", "identity"), ("gate.weight", "zeros"), ("down.weight", "identity")),
}
TARGETS = ("q", "k", "v")
_PROJ_KEY = re.compile(r"^(.*)layers\.0\.self_attn\.q_proj\.weight$")
KNOCK_KEY = re.compile(r"^(?P<prefix>.*)layers\.(?P<layer>\d+)\.self_attn\.(?P<target>[qkv])_knock\.(?P<part>.+)$")


def knock_key(prefix: str, layer: int, target: str, part: str) -> str:
    """The one template for knock tensor names."""
    return f"{prefix}layers.{layer}.self_attn.{target}_knock.{part}"


def projection_key(prefix: str, layer: int, target: str, part: str = "weight") -> str:
    return f"{prefix}layers.{layer}.self_attn.{target}_proj.{part}"


def layer_prefix(tensor_names) -> str:
    """The prefix in front of `layers.` in a checkpoint (`model.` for ...ForCausalLM checkpoints)."""
    for name in tensor_names:
        match = _PROJ_KEY.match(name)
        if match:
            return match.group(1)
    raise ValueError("no `layers.0.self_attn.q_proj.weight` tensor: not a Llama/Mistral/Qwen-style checkpoint")


def knock_specs(config: KHAConfig, prefix: str = "model.") -> dict[str, str]:
    """Knock tensor name -> its initial value ('identity' or 'zeros'), for every knocked layer."""
    specs: dict[str, str] = {}
    for layer in config.knocked_layers:
        for target in TARGETS:
            kind = getattr(config, f"knock_{target}")
            for part, start in KNOCK_PARTS.get(kind, ()):
                specs[knock_key(prefix, layer, target, part)] = start
    return specs


def initial_knock_tensors(config: KHAConfig, dtype: torch.dtype, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The knock tensors of a freshly converted model: exact identities (and zeros for MLP gates)."""
    d = config.kha_head_dim
    make = {"identity": lambda: torch.eye(d, dtype=dtype), "zeros": lambda: torch.zeros(d, d, dtype=dtype)}
    return {name: make[start]() for name, start in knock_specs(config, prefix).items()}

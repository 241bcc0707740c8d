"""Knock tensor names and their initial values, from one per-layer template; projection names.

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
    "gate": (("gate.weight", "zeros"),),
}
TARGETS = ("q", "k", "v")
KNOCK_KEY = re.compile(r"^(?P<prefix>.*)layers\.(?P<layer>\d+)\.self_attn\.(?P<target>[qkv])_knock\.(?P<part>.+)$")


def knock_key(prefix: str, layer: int, target: str, part: str) -> str:
    """The one template for knock tensor names."""
    return f"{prefix}layers.{layer}.self_attn.{target}_knock.{part}"


def projection_key(prefix: str, layer: int, projection: str, part: str = "weight") -> str:
    """The tensor name of a projection, e.g. `model.layers.0.self_attn.qkv_proj.weight`."""
    return f"{prefix}layers.{layer}.self_attn.{projection}.{part}"


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

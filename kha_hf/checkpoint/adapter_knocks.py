"""A knock adapter's trained knocks, and what a base checkpoint converted with them becomes.

`peft.adapter_files.read_knock_adapter` reads an adapter folder into `TrainedKnocks`; `kha convert --adapter`
(`conversion.converter`) and PEFT's check of an adapter against a base folder (`peft.adapter_files`) build the KHA
config the adapter describes on that base (`adapter_kha_config`) and check its knocks against the ones that model
needs (`adapter_knocks`, by the rule of `checks.check_knocks_fit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.errors import KHAError
from ..modeling.configuration_kha import KHAConfig
from .checks import check_knocks_fit


@dataclass(frozen=True)
class TrainedKnocks:
    """Knocks trained on a base model elsewhere (a PEFT knock adapter), for `convert` to write instead of
    identities."""

    knock_types: dict[str, str]  # q / k / v -> linear or mlp (targets without a knock left out)
    knock_layers: list[int] | None  # None: every attention layer
    base_model_type: str | None  # the family they were trained on, when recorded
    tensors: dict[str, torch.Tensor]  # by the KHA model's names (`model.layers.3.self_attn.v_knock.up.weight`)
    folder: Path | None = None  # where they were read: a source, which DST may not be, hold or lie in


def adapter_kha_config(base_config: dict, adapter: TrainedKnocks, folder: Path) -> KHAConfig:
    """The KHA config of BASE_CONFIG with the knock types and layers of ADAPTER."""
    recorded = adapter.base_model_type
    if recorded is not None and recorded != base_config.get("model_type"):
        raise KHAError(f"the adapter was trained on a {recorded} model; {folder} is {base_config.get('model_type')!r}")
    types = {f"knock_{t}": adapter.knock_types.get(t, "none") for t in ("q", "k", "v")}
    return KHAConfig.from_base(base_config, knock=None, knock_layers=adapter.knock_layers, **types)


def adapter_knocks(
    identities: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """TRAINED (an adapter's knocks, by KHA name) in place of IDENTITIES: the same names and shapes, cast to the
    checkpoint's dtype; one line naming the first difference otherwise (an adapter of another model)."""
    check_knocks_fit(
        {name: tuple(tensor.shape) for name, tensor in identities.items()},
        trained,
        lambda missing, extra: KHAError(
            f"the adapter's knocks do not fit {what}: {len(missing)} missing {missing[:2]}, {len(extra)} unexpected "
            f"{extra[:2]} (an adapter of another model?)"
        ),
        lambda name, shape, needed: KHAError(
            f"the adapter's {name} has shape {shape}, {what} needs {needed} (an adapter of another model size?)"
        ),
    )
    return {name: trained[name].to(identities[name].dtype).contiguous() for name in identities}

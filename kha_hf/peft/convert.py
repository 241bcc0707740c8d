"""Between the two forms of trained knocks: a knock adapter on a stock model and a KHA model.

`to_kha_model(peft_model)`: the servable form of an adapter (MLP knocks cannot merge into a stock model);
`knock_adapter_from_kha(kha_model)`: a KHA model's knocks as a knock adapter on its stock base. Both are exact: the
knocks are the same tensors under the other naming (`...self_attn.q_proj.knock_sets.<adapter>.q_knock.weight` on
the adapter, `...self_attn.q_knock.weight` in a KHA model).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from .config import KnockConfig

_ADAPTER_KEY = re.compile(r"^(?P<layer>.*)\.[^.]+\.knock_sets\.(?P<adapter>[^.]+)\.(?P<knock>[qkv]_knock\..+)$")


def kha_knock_state_dict(peft_model: nn.Module, adapter_name: str = "default") -> dict[str, Any]:
    """ADAPTER_NAME's knocks under the names a KHA model of the same base gives them
    (`model.layers.3.self_attn.v_knock.weight`); tensors shared, not copied."""
    base = peft_model.get_base_model()
    state = {}
    for name, tensor in base.state_dict().items():
        match = _ADAPTER_KEY.match(name)
        if match and match["adapter"] == adapter_name:
            state[f"{match['layer']}.{match['knock']}"] = tensor
    if not state:
        raise ValueError(f"the model holds no knock adapter named {adapter_name!r}")
    return state


def to_kha_model(peft_model: nn.Module, adapter_name: str = "default") -> nn.Module:
    """A `KHAForCausalLM` of the base model with ADAPTER_NAME's knocks: the servable form of a knock adapter (an MLP
    knock cannot be merged into a stock model). Like `merge_and_unload`, it unwraps the PeftModel's base model in
    place; the KHA model shares its tensors. `save_pretrained` it for kha serve or vLLM."""
    from ..modeling.modeling_kha import KHAForCausalLM

    config: KnockConfig = peft_model.peft_config[adapter_name]
    if not isinstance(config, KnockConfig):
        raise ValueError(f"adapter {adapter_name!r} is a {type(config).__name__}, not a knock adapter")
    knocks = kha_knock_state_dict(peft_model, adapter_name)
    types = {f"knock_{t}": config.knock_types.get(t, "none") for t in ("q", "k", "v")}
    base = peft_model.unload()
    model = KHAForCausalLM.from_base(base, knock=None, knock_layers=config.knock_layers, **types)
    missing, unexpected = model.load_state_dict(knocks, strict=False)
    knock_missing = [key for key in missing if "_knock." in key]
    if knock_missing or unexpected:
        raise ValueError(
            f"the adapter's knocks do not match the KHA model: missing {knock_missing[:3]}, extra {unexpected[:3]}"
        )
    return model


def knock_adapter_from_kha(kha_model: nn.Module, adapter_name: str = "default") -> nn.Module:
    """A `PeftModel` of KHA_MODEL's stock base with its knocks as a knock adapter (logits equal the KHA model's).

    The stock model is built from the KHA model's base config and shares its tensors (no copy)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    config = kha_model.config
    if getattr(config, "model_type", None) != "kha":
        raise ValueError(f"{type(kha_model).__name__} is not a KHA model")
    base_config = config.to_base_config()
    base_config._attn_implementation = config._attn_implementation
    with torch.device("meta"):
        stock = AutoModelForCausalLM.from_config(base_config)
    state = {k: v for k, v in kha_model.state_dict().items() if "_knock." not in k}
    missing, unexpected = stock.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"the KHA model does not map onto its base: missing {missing[:3]}, extra {unexpected[:3]}")
    for module_name, module in stock.named_modules():  # non-persistent buffers (rotary frequencies)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                kha_buffer = kha_model.get_buffer(f"{module_name}.{name}" if module_name else name)
                module.register_buffer(name, kha_buffer, persistent=False)
    types = {f"knock_{t}": getattr(config, f"knock_{t}") for t in ("q", "k", "v")}
    peft_config = KnockConfig(knock="linear_qkv", knock_layers=config.knock_layers, **types)
    peft_model = get_peft_model(stock, peft_config, adapter_name=adapter_name)
    knocks = {name: p for name, p in kha_model.named_parameters() if "_knock." in name}
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            match = _ADAPTER_KEY.match(name.removeprefix("base_model.model."))
            if match:
                param.copy_(knocks.pop(f"{match['layer']}.{match['knock']}"))
    peft_model.train(kha_model.training)  # get_peft_model leaves modules in training mode (dropout on)
    if knocks:
        raise ValueError(f"knocks of the KHA model without a place in the adapter: {sorted(knocks)[:3]}")
    return peft_model

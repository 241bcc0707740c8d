"""What trains: `knocks` (only the knocks), `lora` (knocks fully + LoRA adapters via PEFT), or `full`."""

from __future__ import annotations

from torch import nn

from ..common.errors import KHAError
from .params import KNOCK_MODULE_NAMES, is_knock_parameter

MODES = ("knocks", "lora", "full")
DEFAULT_LR = {"knocks": 1e-3, "lora": 2e-4, "full": 5e-5}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prepare_for_mode(model: nn.Module, mode: str, lora_r: int = 16, lora_alpha: int = 32) -> nn.Module:
    """Set requires_grad (knocks, full) or wrap in a PEFT LoRA model whose `modules_to_save` are the knocks."""
    if mode not in MODES:
        raise KHAError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if not any(is_knock_parameter(n) for n, _ in model.named_parameters()):
        raise KHAError("the model has no knocks: convert it to KHA first (kha convert)")
    if mode == "knocks":
        for name, param in model.named_parameters():
            param.requires_grad_(is_knock_parameter(name))
        return model
    if mode == "full":
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m) is nn.Linear}
    knock_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} & set(KNOCK_MODULE_NAMES)
    config = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=0.0,
        target_modules=sorted(set(LORA_TARGETS) & linear_names),
        # Knocks train fully and are saved with the adapter; LoRA cannot wrap them meaningfully (tiny d_h x d_h).
        modules_to_save=sorted(knock_names),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)

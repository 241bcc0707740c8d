"""Knock parameters: naming, counting and optimizer groups that keep them out of weight decay.

Weight decay pulls a parameter toward 0, but a knock's neutral point is the identity (or, for the MLP gate, 0 with
the identity elsewhere): decaying knocks would push a converted model away from its base. So knocks get no decay.
"""

from __future__ import annotations

import torch
from torch import nn

KNOCK_MODULE_NAMES = ("q_knock", "k_knock", "v_knock")


def is_knock_parameter(name: str) -> bool:
    """True for a knock weight (`...self_attn.v_knock.up.weight`), counted once on PEFT-wrapped models too.

    PEFT's `modules_to_save` keeps a frozen `original_module` next to the trained copy, and a LoRA on a knock adds
    `lora_A`/`lora_B`: neither is a knock weight of the model.
    """
    return (
        any(f"{module}." in name for module in KNOCK_MODULE_NAMES)
        and ".original_module." not in name
        and ".lora_" not in name
    )


def knock_target_modules(model: nn.Module) -> list[str]:
    """Module names PEFT accepts in `LoraConfig(target_modules=...)` to put LoRA on the knocks themselves.

    A linear knock (`q_knock`) is an `nn.Linear`; an MLP knock (`v_knock`) is not, but its three maps are
    (`v_knock.up`, `v_knock.gate`, `v_knock.down`). Example: `LoraConfig(target_modules=knock_target_modules(model))`.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(f"{knock}" in name.split(".") for knock in KNOCK_MODULE_NAMES):
            suffix = name[name.index(next(k for k in KNOCK_MODULE_NAMES if k in name.split("."))) :]
            if ".original_module" not in suffix and ".modules_to_save" not in suffix:
                names.append(suffix)
    return sorted(set(names))


def knock_parameter_names(model: nn.Module) -> list[str]:
    """Names of all knock parameters of `model` (works on PEFT-wrapped models too)."""
    return [name for name, _ in model.named_parameters() if is_knock_parameter(name)]


def count_knock_parameters(model: nn.Module) -> int:
    """Number of knock weights: 3 * head_dim**2 per knocked layer for mlp_v and for linear_qkv."""
    return sum(p.numel() for name, p in model.named_parameters() if is_knock_parameter(name))


def optimizer_param_groups(
    model: nn.Module,
    weight_decay: float = 0.1,
    lr: float | None = None,
    knock_lr: float | None = None,
    only_trainable: bool = True,
    decay_names: set[str] | None = None,
) -> list[dict]:
    """Param groups for torch optimizers: decayed weights, undecayed weights, and knocks (no decay, own lr).

    Non-knock parameters are decayed if named in `decay_names`, or by default if they are matrices (biases and
    norm weights, 1-D, are not, as in transformers' Trainer).

    Example:
        torch.optim.AdamW(optimizer_param_groups(model, weight_decay=0.1, lr=3e-4, knock_lr=1e-3), betas=(0.9, 0.95))
    """
    decay, no_decay, knocks = [], [], []
    for name, param in model.named_parameters():
        if only_trainable and not param.requires_grad:
            continue
        if is_knock_parameter(name):
            knocks.append(param)
        elif name in decay_names if decay_names is not None else param.ndim >= 2:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": knocks, "weight_decay": 0.0},
    ]
    if lr is not None:
        for group in groups:
            group["lr"] = lr
    if knock_lr is not None:
        groups[2]["lr"] = knock_lr
    return [g for g in groups if g["params"]]


def knock_distance_from_init(model: nn.Module) -> float:
    """Mean over knock matrices of ‖W − W0‖_F (W0 = I, or 0 for MLP gates): how far training moved the knocks."""
    from ..modeling.knocks import KnockLinear

    distances = []
    for module in model.modules():
        if isinstance(module, KnockLinear):
            weight = module.weight.detach().float()
            initial = torch.eye(weight.shape[0], device=weight.device) if module.start == "identity" else 0.0
            distances.append(torch.linalg.norm(weight - initial).item())
    return sum(distances) / len(distances) if distances else 0.0

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

    Args:
        name: a parameter name as `model.named_parameters()` gives it.

    Returns:
        Whether the parameter is a weight of a `q_knock`, `k_knock` or `v_knock` (a matrix of shape
        `(head_dim, head_dim)`, or one of an MLP knock's `up`, `gate`, `down` maps).
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

    Args:
        model: a KHA model, or a PEFT-wrapped one (the copies PEFT keeps are left out).

    Returns:
        The sorted, distinct module-name suffixes (`["q_knock", "v_knock.down", ...]`); empty for a model without
        knocks.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(f"{knock}" in name.split(".") for knock in KNOCK_MODULE_NAMES):
            suffix = name[name.index(next(k for k in KNOCK_MODULE_NAMES if k in name.split("."))) :]
            if ".original_module" not in suffix and ".modules_to_save" not in suffix:
                names.append(suffix)
    return sorted(set(names))


def knock_parameter_names(model: nn.Module) -> list[str]:
    """Names of all knock parameters of `model` (works on PEFT-wrapped models too).

    Args:
        model: any `nn.Module`; a KHA model, a knock adapter's `PeftModel`, or a stock model (then `[]`).

    Returns:
        The names, in `model.named_parameters()` order, for which `is_knock_parameter` holds.
    """
    return [name for name, _ in model.named_parameters() if is_knock_parameter(name)]


def count_knock_parameters(model: nn.Module) -> int:
    """Number of knock weights: 3 * head_dim**2 per knocked layer for mlp_v and for linear_qkv.

    `linear_v` has head_dim**2 per knocked layer; each knock is counted once on a PEFT-wrapped model (SmolLM2-135M,
    30 layers of head_dim 64: 368,640 for `mlp_v`).

    Args:
        model: any `nn.Module` (0 for a model without knocks).

    Returns:
        The number of scalar knock weights, trainable or not.
    """
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

    Args:
        model: the model whose parameters are grouped (a KHA model, PEFT-wrapped or not).
        weight_decay: the decay of the first group (default 0.1, the paper's); the other two get 0.
        lr: a learning rate set on every group (default: none, the optimizer's own `lr` applies).
        knock_lr: the knocks' learning rate (default: `lr`, or the optimizer's).
        only_trainable: leave out parameters with `requires_grad=False` (default True).
        decay_names: the names of the non-knock parameters to decay (default: every parameter with 2 or more
            dimensions).

    Returns:
        Up to three dicts for `torch.optim` (`{"params": [...], "weight_decay": ...}`, with `"lr"` where given), in
        the order decayed, undecayed, knocks; an empty group is left out.

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
            weight = module.weight.detach()
            # FSDP2 / TP: a DTensor, gathered on every rank (Trainer logs on every rank)
            weight = (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).float()
            initial = torch.eye(weight.shape[0], device=weight.device) if module.start == "identity" else 0.0
            distances.append(torch.linalg.norm(weight - initial).item())
    return sum(distances) / len(distances) if distances else 0.0

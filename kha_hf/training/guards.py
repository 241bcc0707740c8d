"""Checks that keep `kha train` from producing a silent bad result: a run that cannot take one step, a logger
that does not exist, a loss or knocks that became NaN or infinite, a checkpoint that is not plain weights."""

from __future__ import annotations

import math
import re

import torch
from transformers import TrainerCallback

from ..common.errors import KHAError
from .params import is_knock_parameter


def check_report_to(report_to: str | list[str] | None) -> list[str]:
    """--report-to names Trainer loggers that exist and are installed ('none', 'all' or e.g. 'tensorboard,wandb');
    returns them as the list TrainingArguments takes (it would read 'tensorboard,wandb' as one unknown name)."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    names = report_to if isinstance(report_to, list) else str(report_to or "none").split(",")
    names = [name.strip() for name in names if name.strip()]
    if names in ([], ["none"], ["all"]):
        return names or ["none"]
    if "none" in names or "all" in names:
        raise KHAError(f"--report-to {','.join(names)}: 'none' and 'all' cannot be combined with other loggers")
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            raise KHAError(
                f"--report-to {name!r} is not a Trainer logger; use none, all or any of: "
                f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}"
            )
    for name in names:
        if name not in get_available_reporting_integrations():
            raise KHAError(f"--report-to {name}: the {name} package is not installed (pip install {name})")
    return names


def check_batches(train_blocks: int, batch_size: int, world_size: int = 1) -> None:
    """At least one full batch per device: incomplete batches are dropped, so fewer blocks would train 0 steps."""
    if train_blocks < batch_size * world_size:
        per = f" x {world_size} processes" if world_size > 1 else ""
        raise KHAError(
            f"only {train_blocks} training blocks, fewer than one batch of {batch_size}{per}: nothing would train; "
            "lower --batch-size or --seq-len, or give more --data"
        )


def check_lora_rank(model, lora_r: int, mode: str) -> None:
    """A LoRA rank above the model's width is no low-rank adapter (and 10**9 would allocate until OOM)."""
    hidden = getattr(model.config, "hidden_size", None)
    if mode == "lora" and isinstance(hidden, int) and lora_r > hidden:
        raise KHAError(f"--lora-r {lora_r} exceeds the model's hidden size {hidden}; use a rank below it")


def non_finite_knocks(model) -> list[str]:
    """Names of knock parameters holding NaN or infinite values."""
    return [
        name
        for name, param in model.named_parameters()
        if is_knock_parameter(name) and not torch.isfinite(param.detach()).all()
    ]


def check_training_result(steps: int, train_loss: float, heldout_loss: float, model) -> None:
    """A run that took no step or whose loss or knocks are NaN/infinite produced no trained model: refuse to save."""
    if steps == 0:
        raise KHAError("training ran 0 steps: there is no trained model to save (is there less data than a batch?)")
    problems = []
    if not math.isfinite(train_loss):
        problems.append(f"train loss {train_loss}")
    if not math.isfinite(heldout_loss):
        problems.append(f"held-out loss {heldout_loss}")
    bad = non_finite_knocks(model)
    if bad:
        problems.append(f"{len(bad)} knock tensors hold NaN or infinite values ({bad[0]})")
    if problems:
        raise KHAError(
            f"training diverged ({'; '.join(problems)}): the model was not saved; try a lower --lr "
            "(checkpoints written so far are kept for inspection, if any)"
        )


class StopOnNonFiniteLoss(TrainerCallback):
    """Stop a run at the first NaN or infinite logged loss: every later step would only compute NaN."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        model = kwargs.get("model")
        diverged = isinstance(loss, (int, float)) and not math.isfinite(loss)
        if diverged or (loss is not None and model is not None and non_finite_knocks(model)):
            control.should_training_stop = True
            control.should_save = False
        return control


def unpickling_reason(err: BaseException) -> str:
    """One line for torch.load(weights_only=True) refusing a checkpoint file (its message spans a dozen lines)."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    what = f"it names {found.group(1)}" if found else "it holds objects other than tensors"
    return f"a file there is not plain weights ({what}); only weights are loaded, so nothing of it ran"

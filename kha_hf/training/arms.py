"""Training one arm of a comparison: same seed, same batches, same optimiser as its sibling arms."""

from __future__ import annotations

import time
from pathlib import Path

from torch import nn

from .ab_report import ArmRun
from .train import paper_training_arguments
from .trainer import KHATrainer


def train_arm(
    model: nn.Module,
    arm: str,
    seed: int,
    output_dir: Path,
    train_set,
    heldout_set,
    steps: int,
    batch_size: int,
    lr: float,
    measure_before: bool = True,
    disable_tqdm: bool = False,
    weight_decay: float = 0.1,
) -> ArmRun:
    """Train MODEL (its trainable parameters, set by the caller) with the paper's optimiser; nothing is saved.

    Every arm of one seed sees the same batches in the same order (`seed` and `data_seed`), so arms are paired.
    WEIGHT_DECAY applies to what the Trainer decays (never knocks); the wall time of the training is recorded.
    """
    args = paper_training_arguments(
        output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        learning_rate=lr,
        logging_steps=max(1, steps // 12),
        save_strategy="no",
        seed=seed,
        data_seed=seed,
        disable_tqdm=disable_tqdm,  # the step bar (step/total, rate, ETA) unless asked not to
        weight_decay=weight_decay,
    )
    trainer = KHATrainer(model=model, args=args, train_dataset=train_set, eval_dataset=heldout_set)
    heldout_before = trainer.evaluate()["eval_loss"] if measure_before else None
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    heldout = trainer.evaluate()["eval_loss"]
    curve = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return ArmRun(arm, seed, curve, curve[-1][1], heldout, heldout_before, wall_seconds=wall)

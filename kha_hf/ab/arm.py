"""One arm of a comparison, trained and measured (`train_arm`), and what it leaves (`ArmRun`): same seed, same
batches, same optimiser as its sibling arms."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..training.deepspeed_config import quiet_deepspeed_cpu_notice
from ..training.schedules import Schedule
from ..training.train import paper_training_arguments
from ..training.trainer import KHATrainer
from ..training.validation_log import METRIC


@dataclass
class ArmRun:
    arm: str  # "baseline", "kha", "kha-knocks", "lora", ...
    seed: int
    curve: list[tuple[int, float]]  # (step, training loss)
    train_loss: float  # last logged training loss
    heldout_loss: float
    heldout_before: float | None = None
    trainable_parameters: int | None = None
    wall_seconds: float | None = None
    lr: float | None = None
    validation_loss: float | None = None
    heldout_blocks: list[float] | None = None  # per-block held-out losses (continued A/B)
    other_blocks: list[float] | None = None  # per-block losses on the other-domain text
    flops: float | None = None  # estimated training FLOPs
    stability: list[dict] | None = None  # per optimizer step: loss, gradient norms, lr, logits (training/stability)
    validation_curve: list[tuple[int, float]] | None = None  # (step, validation loss) with eval_steps
    model: object = field(default=None, repr=False)  # kept only when the run is evaluated afterwards


def train_arm(
    model,
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
    logging_steps: int | None = None,
    bf16: bool = False,
    stability_every: int | None = None,
    schedule: Schedule | None = None,
    eval_steps: int | None = None,
    validation_set=None,
    peak_flops: float | None = None,
) -> ArmRun:
    """Train MODEL (its trainable parameters, set by the caller) with the paper's optimiser; nothing is saved.

    Every arm of one seed sees the same batches in the same order (`seed` and `data_seed`), so arms are paired.
    WEIGHT_DECAY applies to what the Trainer decays (never knocks); the wall time of the training is recorded, and
    with STABILITY_EVERY the per-step records (attention logits every STABILITY_EVERY steps). SCHEDULE: the
    learning-rate schedule (default: the paper's). EVAL_STEPS: VALIDATION_SET's loss every N steps (the curve).
    PEAK_FLOPS: one device's peak, for the MFU in each log.
    """
    quiet_deepspeed_cpu_notice()
    args = paper_training_arguments(
        output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        learning_rate=lr,
        logging_steps=logging_steps or max(1, steps // 12),
        save_strategy="no",
        seed=seed,
        data_seed=seed,
        bf16=bf16,
        disable_tqdm=disable_tqdm,  # the step bar (step/total, rate, ETA) unless asked not to
        weight_decay=weight_decay,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        **(schedule or Schedule()).training_arguments(steps),
    )
    trainer = KHATrainer(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset={"validation": validation_set} if eval_steps else heldout_set,
        stability_every=stability_every,
        seq_len=len(train_set[0]["input_ids"]),
        peak_flops=peak_flops,
    )
    trainer.fit_eval_batch(heldout_set)
    heldout_before = trainer.evaluate(heldout_set)["eval_loss"] if measure_before else None
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    heldout = trainer.evaluate(heldout_set)["eval_loss"]
    history = trainer.state.log_history
    curve = [(h["step"], h["loss"]) for h in history if "loss" in h]
    validation = [(h["step"], h[METRIC]) for h in history if METRIC in h] if eval_steps else None
    stability = trainer.stability.rows if trainer.stability is not None else None
    return ArmRun(
        arm, seed, curve, curve[-1][1], heldout, heldout_before, wall_seconds=wall, stability=stability,
        validation_curve=validation,
    )  # fmt: skip

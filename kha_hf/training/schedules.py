"""Learning-rate schedules for `kha train` and `kha ab` (`--lr-scheduler`), each one of transformers' own schedulers,
named to TrainingArguments (`lr_scheduler_type`, `lr_scheduler_kwargs`, `warmup_steps`):

- `cosine` (the paper's, the default): linear warmup, cosine decay to `min_lr_ratio` of the peak (default 0.1):
  transformers' `cosine_with_min_lr`.
- `wsd` (warmup-stable-decay): linear warmup, the peak held, then the last `decay_ratio` of the steps (default 0.2)
  decayed by a cosine to `min_lr_ratio` (default 0): transformers' `warmup_stable_decay`.
- `linear`: linear warmup, linear decay to `min_lr_ratio` (default 0): `warmup_stable_decay` with no stable phase
  and a linear decay (transformers' `linear` has no floor).
- `constant`: linear warmup, then the peak: `constant_with_warmup` (a floor does not apply).

Warmup: `warmup_steps` optimizer steps, or `warmup_ratio` of the run (default 0.05, the paper's); not both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..common.errors import KHAError

SCHEDULES = ("cosine", "wsd", "linear", "constant")
PAPER_WARMUP_RATIO = 0.05
DEFAULT_MIN_LR_RATIO = {"cosine": 0.1, "wsd": 0.0, "linear": 0.0}
DEFAULT_DECAY_RATIO = 0.2  # WSD: the share of the run spent decaying (MiniCPM's and most WSD runs' 10-20 %)


@dataclass(frozen=True)
class Schedule:
    """A run's schedule: its name and the numbers it was given (None: the schedule's default)."""

    name: str = "cosine"
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    min_lr_ratio: float | None = None
    decay_ratio: float | None = None

    def check(self) -> Schedule:
        """This schedule, or a one-line KHAError for a choice that does not apply or a number out of range."""
        if self.name not in SCHEDULES:
            raise KHAError(f"unknown --lr-scheduler {self.name!r}; choose one of: {', '.join(SCHEDULES)}")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise KHAError("--warmup-steps and --warmup-ratio both set the warmup: give one")
        if self.warmup_steps is not None and (type(self.warmup_steps) is not int or self.warmup_steps < 0):
            raise KHAError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        for flag, value in (("--warmup-ratio", self.warmup_ratio), ("--min-lr-ratio", self.min_lr_ratio)):
            if value is not None and not 0 <= value <= 1:
                raise KHAError(f"{flag} must be between 0 and 1, got {value}")
        if self.decay_ratio is not None and (self.name != "wsd" or not 0 < self.decay_ratio <= 1):
            raise KHAError(
                "--decay-ratio applies to --lr-scheduler wsd only"
                if self.name != "wsd"
                else f"--decay-ratio must be above 0 and at most 1, got {self.decay_ratio}"
            )
        if self.min_lr_ratio is not None and self.name == "constant":
            raise KHAError("--min-lr-ratio does not apply to --lr-scheduler constant (it never decays)")
        return self

    def warmup(self, max_steps: int) -> int:
        """The warmup's optimizer steps in a run of MAX_STEPS."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        ratio = PAPER_WARMUP_RATIO if self.warmup_ratio is None else self.warmup_ratio
        return math.ceil(ratio * max_steps)  # as TrainingArguments.get_warmup_steps rounds a ratio

    def training_arguments(self, max_steps: int) -> dict:
        """TrainingArguments' schedule fields for a run of MAX_STEPS (a warmup longer than the run is refused)."""
        self.check()
        warmup = self.warmup(max_steps)
        if warmup > max_steps:
            raise KHAError(f"a warmup of {warmup} steps is longer than the run's {max_steps} steps")
        floor = self.min_lr_ratio if self.min_lr_ratio is not None else DEFAULT_MIN_LR_RATIO.get(self.name)
        if self.name == "cosine":
            return dict(warmup_steps=warmup, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={
                "min_lr_rate": floor})  # fmt: skip
        if self.name == "constant":
            return dict(warmup_steps=warmup, lr_scheduler_type="constant_with_warmup", lr_scheduler_kwargs={})
        if self.name == "wsd":
            decay = math.ceil((self.decay_ratio or DEFAULT_DECAY_RATIO) * max_steps)
            decay = min(decay, max_steps - warmup)
            kind = "cosine"
        else:  # linear: warmup, then every remaining step decays
            decay, kind = max_steps - warmup, "linear"
        return dict(
            warmup_steps=warmup,
            lr_scheduler_type="warmup_stable_decay",
            lr_scheduler_kwargs={
                "num_decay_steps": decay,  # the stable phase is the rest: transformers counts it from max_steps
                "decay_type": kind,
                "min_lr_ratio": floor,
            },
        )

    def describe(self, max_steps: int) -> str:
        """One line for the start of a run: 'cosine: 15 warmup steps, then to 10 % of the peak'."""
        warmup = self.warmup(max_steps)
        floor = self.min_lr_ratio if self.min_lr_ratio is not None else DEFAULT_MIN_LR_RATIO.get(self.name)
        if self.name == "constant":
            return f"constant after {warmup} warmup step{'s' * (warmup != 1)}"
        if self.name == "wsd":
            decay = self.training_arguments(max_steps)["lr_scheduler_kwargs"]["num_decay_steps"]
            return (
                f"wsd: {warmup} warmup, {max_steps - warmup - decay} stable, {decay} decay steps to "
                f"{floor:.0%} of the peak"
            )
        return f"{self.name}: {warmup} warmup step{'s' * (warmup != 1)}, then to {floor:.0%} of the peak"

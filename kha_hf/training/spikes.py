"""Loss spikes: the definition behind the paper's "far fewer loss spikes" (light: the CLI checks margins with it)."""

from __future__ import annotations

import math
import statistics

SPIKE_WINDOW = 100  # the median of the previous 100 steps' losses
SPIKE_MIN_HISTORY = 10  # a step is judged only once this many steps precede it
SPIKE_MARGIN = 0.1  # a spike: loss above that median by more than 10 % of it


def check_spike_margin(margin: float) -> float:
    """MARGIN (relative: 0.1 is 10 % above the median) if positive and finite; ValueError in one line otherwise."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"the spike margin must be a positive number (0.1: 10 % above the median), got {margin!r}")
    return float(margin)


def spike_steps(losses: list[float], window: int = SPIKE_WINDOW, margin: float = SPIKE_MARGIN) -> list[int]:
    """Indices of the spike steps in LOSSES (one per optimizer step, in order).

    Definition: step t is a spike step when `loss[t] > (1 + margin) * median(loss[t-window:t])`, judged from the
    SPIKE_MIN_HISTORY-th step on; a non-finite loss after that is a spike step too. Early training's falling loss is
    below its past median, so it never counts."""
    margin = check_spike_margin(margin)
    found = []
    for t in range(SPIKE_MIN_HISTORY, len(losses)):
        past = [x for x in losses[max(0, t - window) : t] if math.isfinite(x)]
        if not past:
            continue
        if not math.isfinite(losses[t]) or losses[t] > (1 + margin) * statistics.median(past):
            found.append(t)
    return found


def count_spikes(losses: list[float], window: int = SPIKE_WINDOW, margin: float = SPIKE_MARGIN) -> int:
    """The number of loss spikes: maximal runs of consecutive spike steps (`spike_steps`), each counted once."""
    steps = spike_steps(losses, window, margin)
    return sum(1 for i, t in enumerate(steps) if i == 0 or steps[i - 1] != t - 1)

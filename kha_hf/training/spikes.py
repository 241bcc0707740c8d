"""Loss spikes: the definition behind the paper's "far fewer loss spikes" (light: the CLI checks margins with it)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Iterator

SPIKE_WINDOW = 100  # the median of the previous 100 steps' losses
SPIKE_MIN_HISTORY = 10  # a step is judged only once this many steps precede it
SPIKE_MARGIN = 0.1  # a spike: loss above that median by more than 10 % of it


def check_spike_margin(margin: float) -> float:
    """MARGIN (relative: 0.1 is 10 % above the median) if positive and finite; ValueError in one line otherwise."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"the spike margin must be a positive number (0.1: 10 % above the median), got {margin!r}")
    return float(margin)


def spike_flags(losses: Iterable[float], window: int = SPIKE_WINDOW, margin: float = SPIKE_MARGIN) -> Iterator[bool]:
    """For each loss of LOSSES (one per optimizer step, in order), whether its step is a spike step; streams, holding
    WINDOW losses at most (a 1T-token run has tens of millions of steps).

    Definition: step t is a spike step when `loss[t] > (1 + margin) * median(loss[t-window:t])`, judged from the
    SPIKE_MIN_HISTORY-th step on; a non-finite loss after that is a spike step too. Early training's falling loss is
    below its past median, so it never counts."""
    margin = check_spike_margin(margin)
    past: deque[float] = deque(maxlen=window)
    for t, loss in enumerate(losses):
        finite = [x for x in past if math.isfinite(x)]
        judged = t >= SPIKE_MIN_HISTORY and finite
        yield bool(judged) and (not math.isfinite(loss) or loss > (1 + margin) * statistics.median(finite))
        past.append(loss)


def spike_steps(losses: Iterable[float], window: int = SPIKE_WINDOW, margin: float = SPIKE_MARGIN) -> list[int]:
    """Indices of the spike steps in LOSSES (`spike_flags`)."""
    return [t for t, spike in enumerate(spike_flags(losses, window, margin)) if spike]


def count_spikes(losses: Iterable[float], window: int = SPIKE_WINDOW, margin: float = SPIKE_MARGIN) -> int:
    """The number of loss spikes: maximal runs of consecutive spike steps (`spike_flags`), each counted once."""
    count, previous = 0, False
    for spike in spike_flags(losses, window, margin):
        count += spike and not previous
        previous = spike
    return count

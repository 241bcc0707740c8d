"""Paired statistics for two models scored on the same documents, and for A/B runs repeated over seeds.

Two models evaluated on the same documents are paired samples: what matters is the per-document difference
d_i = candidate_i − baseline_i, not two independent standard errors. Between a converted model and its trained
version most d_i are 0, so the paired standard error is far smaller than √(se_b² + se_c²).

- `paired_difference`: mean of d, its standard error and 95 % t-interval; p-value from the exact McNemar test
  (a two-sided binomial test on the discordant pairs) for 0/1 metrics such as acc / acc_norm, and from a paired
  permutation (sign-flip) test with a fixed seed for continuous metrics. scipy does the tests.
- `seed_interval`: mean of per-seed paired differences with a 95 % t-interval (for `kha ab --seeds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

PERMUTATIONS = 10_000  # resamples of the sign-flip test for continuous metrics
SEED = 0  # fixed, so the same inputs always give the same p-value


def _t_interval(diffs: np.ndarray) -> tuple[float, float, float]:
    """(mean, standard error, half-width of the 95 % t-interval); zero width for n < 2 or constant input."""
    from scipy import stats

    n = len(diffs)
    mean = float(diffs.mean()) if n else 0.0
    if n < 2:
        return mean, float("nan") if n == 0 else 0.0, float("nan") if n == 0 else 0.0
    se = float(diffs.std(ddof=1) / math.sqrt(n))
    return mean, se, float(stats.t.ppf(0.975, n - 1) * se)


def is_binary(*samples: Sequence[float]) -> bool:
    return all(float(v) in (0.0, 1.0) for sample in samples for v in sample)


def paired_difference(baseline: Sequence[float], candidate: Sequence[float]) -> dict:
    """Candidate − baseline over paired documents: {delta, stderr, ci95, p_value, n, discordant, test}.

    Identical scores give delta 0, CI [0, 0] and p 1.
    """
    from scipy import stats

    b = np.asarray(baseline, dtype=np.float64)
    c = np.asarray(candidate, dtype=np.float64)
    if b.shape != c.shape:
        raise ValueError(f"paired samples differ in length: {b.shape} vs {c.shape}")
    d = c - b
    mean, se, half = _t_interval(d)
    discordant = int(np.count_nonzero(d))
    if discordant == 0:
        p_value, test = 1.0, "identical"
    elif is_binary(b, c):
        wins = int(np.count_nonzero(d > 0))  # candidate right, baseline wrong
        p_value, test = float(stats.binomtest(wins, discordant, 0.5).pvalue), "exact McNemar"
    else:
        result = stats.permutation_test(
            (d,),
            np.mean,
            permutation_type="samples",  # sign flips of the paired differences
            n_resamples=PERMUTATIONS,
            alternative="two-sided",
            random_state=SEED,
        )
        p_value, test = float(result.pvalue), "paired permutation"
    return {
        "delta": mean,
        "stderr": se,
        "ci95": [mean - half, mean + half],
        "p_value": min(1.0, p_value),
        "n": int(len(d)),
        "discordant": discordant,
        "test": test,
    }


def seed_interval(differences: Sequence[float]) -> dict:
    """Mean of per-seed paired differences with a 95 % t-interval over seeds, and whether it excludes 0."""
    d = np.asarray(differences, dtype=np.float64)
    mean, se, half = _t_interval(d)
    low, high = mean - half, mean + half
    return {
        "delta_mean": mean,
        "stderr": se,
        "ci95": [low, high],
        "n_seeds": int(len(d)),
        "excludes_zero": bool(len(d) >= 2 and (low > 0 or high < 0)),
    }

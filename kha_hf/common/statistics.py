"""Paired statistics for two models scored on the same documents, and for A/B runs repeated over seeds.

Two models evaluated on the same documents are paired samples: what matters is the per-document difference
d_i = candidate_i − baseline_i, not two independent standard errors.

- `paired_difference`, for 0/1 metrics (acc, acc_norm): one exact method gives both the interval and the p-value,
  so they cannot disagree. Conditional on the m discordant documents (w candidate wins, m − w losses), w is
  Binomial(m, θ) and the mean difference is Δ = (2θ − 1)·m/n. The 95 % interval is Clopper-Pearson's for θ mapped to
  Δ; p is the exact McNemar test in its central two-sided form, 2·min(P(X ≤ w), P(X ≥ w)) under θ = 1/2, which is
  the test that interval inverts (p < 0.05 exactly when the interval excludes 0; statsmodels' `mcnemar(exact=True)`
  and `proportion_confint(method="beta")` are the references in the tests).
- For continuous metrics: the mean difference with a 95 % t-interval, and p from a seeded paired sign-flip
  permutation test (scipy, in batches so memory stays bounded whatever n). The two can disagree near 0.05.
- Scores that are NaN or infinite are excluded, and counted in `excluded`; fewer than two remaining documents, or
  differences without any spread, give no interval and no p (None), never a confident number.
- `seed_interval` and `two_level_bootstrap`: intervals over the seeds of A/B runs; `holm`: Holm's step-down
  adjustment of a family of p-values (statsmodels).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

PERMUTATIONS = 10_000  # resamples of the sign-flip test for continuous metrics
PERMUTATION_BATCH_VALUES = 2_000_000  # values held at once by the permutation test (about 16 MB of float64)
SEED = 0  # fixed, so the same inputs always give the same p-value
BOOTSTRAP = 10_000


def is_binary(*samples: Sequence[float]) -> bool:
    return all(float(v) in (0.0, 1.0) for sample in samples for v in sample)


def _finite_pairs(baseline: Sequence[float], candidate: Sequence[float]) -> tuple[np.ndarray, np.ndarray, int]:
    b = np.asarray(baseline, dtype=np.float64)
    c = np.asarray(candidate, dtype=np.float64)
    if b.shape != c.shape:
        raise ValueError(f"paired samples differ in length: {b.shape} vs {c.shape}")
    keep = np.isfinite(b) & np.isfinite(c)
    return b[keep], c[keep], int(keep.size - keep.sum())


def _t_interval(d: np.ndarray) -> tuple[float, float | None, list[float] | None]:
    """(mean, standard error, 95 % t-interval); None for fewer than 2 values or no spread."""
    from scipy import stats

    n = len(d)
    mean = float(d.mean()) if n else float("nan")
    if n < 2:
        return mean, None, None
    sd = float(d.std(ddof=1))
    if sd <= 1e-12 * float(np.abs(d).max()):  # no spread (up to float rounding of equal differences)
        return mean, 0.0, None
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.975, n - 1)) * se
    return mean, se, [mean - half, mean + half]


def exact_paired_binary(wins: int, losses: int, n: int) -> tuple[float, list[float] | None, float]:
    """(Δ, 95 % interval, p) for 0/1 scores: W wins and L losses of the candidate among N paired documents."""
    from scipy import stats

    discordant = wins + losses
    delta = (wins - losses) / n
    if discordant == 0:
        return delta, None, 1.0
    low, high = stats.binomtest(wins, discordant).proportion_ci(confidence_level=0.95, method="exact")
    interval = [(2 * low - 1) * discordant / n, (2 * high - 1) * discordant / n]
    p = min(1.0, 2 * min(stats.binom.cdf(wins, discordant, 0.5), stats.binom.sf(wins - 1, discordant, 0.5)))
    return delta, interval, float(p)


def _permutation_p(d: np.ndarray) -> float:
    from scipy import stats

    result = stats.permutation_test(
        (d,),
        np.mean,
        permutation_type="samples",  # sign flips of the paired differences
        n_resamples=PERMUTATIONS,
        alternative="two-sided",
        random_state=SEED,
        batch=max(1, PERMUTATION_BATCH_VALUES // len(d)),
    )
    return float(result.pvalue)


def paired_difference(baseline: Sequence[float], candidate: Sequence[float]) -> dict:
    """Candidate − baseline over paired documents:
    {delta, stderr, ci95, p_value, n, excluded, discordant, wins, losses, test}; ci95 and p_value may be None."""
    b, c, excluded = _finite_pairs(baseline, candidate)
    d = c - b
    n = int(len(d))
    discordant = int(np.count_nonzero(d))
    mean, se, interval = _t_interval(d)

    def result(delta, stderr, ci95, p_value, test: str, **counts) -> dict:
        common = {"n": n, "excluded": excluded, "discordant": discordant}
        return {**common, "delta": delta, "stderr": stderr, "ci95": ci95, "p_value": p_value, **counts, "test": test}

    if n < 2:
        return result(mean, None, None, None, "too few documents")
    if discordant == 0:
        return result(0.0, 0.0, None, 1.0, "identical")
    if is_binary(b, c):
        wins, losses = int(np.count_nonzero(d > 0)), int(np.count_nonzero(d < 0))
        delta, interval, p = exact_paired_binary(wins, losses, n)
        return result(delta, se, interval, p, "exact McNemar", wins=wins, losses=losses)
    if interval is None:  # every difference the same: no spread to judge it by
        return result(mean, se, None, None, "no spread")
    return result(mean, se, interval, min(1.0, _permutation_p(d)), "paired permutation")


def seed_interval(differences: Sequence[float]) -> dict:
    """Mean of per-seed paired differences with a 95 % t-interval over seeds, and whether it excludes 0 (None when
    there is no interval: one seed, or seeds that all gave the same difference)."""
    d = np.asarray(differences, dtype=np.float64)
    mean, se, interval = _t_interval(d)
    return {
        "delta_mean": mean,
        "stderr": se,
        "ci95": interval,
        "n_seeds": int(len(d)),
        "excludes_zero": None if interval is None else bool(interval[0] > 0 or interval[1] < 0),
    }


def two_level_bootstrap(per_seed_block_deltas: Sequence[Sequence[float]], seed: int = SEED) -> dict:
    """Mean paired difference over seeds and evaluation blocks (each seed a list of per-block differences), with a
    95 % percentile interval from resampling seeds, then blocks within each resampled seed; None with one seed."""
    deltas = np.asarray(per_seed_block_deltas, dtype=np.float64)  # (seeds, blocks)
    n_seeds, n_blocks = deltas.shape
    mean = float(deltas.mean())
    result = {"delta_mean": mean, "ci95": None, "excludes_zero": None, "n_seeds": n_seeds, "n_blocks": n_blocks}
    if n_seeds < 2 or n_blocks < 2:
        return result
    rng = np.random.default_rng(seed)
    means = np.empty(BOOTSTRAP)
    for i in range(BOOTSTRAP):
        seeds = rng.integers(0, n_seeds, n_seeds)
        blocks = rng.integers(0, n_blocks, (n_seeds, n_blocks))
        means[i] = deltas[seeds[:, None], blocks].mean()
    low, high = (float(v) for v in np.percentile(means, [2.5, 97.5]))
    if low == high:
        return result
    return {**result, "ci95": [low, high], "excludes_zero": bool(low > 0 or high < 0)}


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm-adjusted p-values (None stays None: no test)."""
    from statsmodels.stats.multitest import multipletests

    present = [p for p in p_values if p is not None]
    corrected = iter(multipletests(present, method="holm")[1] if present else ())
    return [None if p is None else float(next(corrected)) for p in p_values]

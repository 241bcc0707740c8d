"""Paired statistics against scipy/statsmodels references and hand-computed cases, edge cases included."""

import json
import math
import tracemalloc

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint

from kha_hf.common.statistics import (
    exact_paired_binary,
    holm,
    paired_difference,
    seed_interval,
    two_level_bootstrap,
)


def test_identical_scores_give_zero_delta_p_one_and_no_interval():
    scores = [1, 0, 1, 1, 0, 0, 1]
    result = paired_difference(scores, scores)
    assert result["delta"] == 0 and result["ci95"] is None and result["p_value"] == 1
    assert result["n"] == 7 and result["discordant"] == 0


def test_binary_interval_and_p_are_the_exact_pair_statsmodels_computes():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(5, 80))
        baseline = rng.integers(0, 2, n)
        candidate = np.where(rng.random(n) < 0.25, 1 - baseline, baseline)
        result = paired_difference(baseline, candidate)
        wins = int(((candidate == 1) & (baseline == 0)).sum())
        losses = int(((candidate == 0) & (baseline == 1)).sum())
        if wins + losses == 0:
            continue
        table = [[0, losses], [wins, 0]]  # only the discordant cells matter
        assert result["p_value"] == pytest.approx(mcnemar(table, exact=True).pvalue, abs=1e-12)
        low, high = proportion_confint(wins, wins + losses, alpha=0.05, method="beta")
        m = wins + losses
        assert result["ci95"] == pytest.approx([(2 * low - 1) * m / n, (2 * high - 1) * m / n], abs=1e-12)
        assert result["delta"] == pytest.approx((wins - losses) / n)
        # one method for both: the interval excludes 0 exactly when p < 0.05
        assert (result["ci95"][0] > 0 or result["ci95"][1] < 0) == (result["p_value"] < 0.05)


def test_the_case_where_a_t_interval_and_mcnemar_disagreed_now_agrees():
    # n = 40, 0 wins / 4 losses: a t-interval excluded 0 while McNemar's p is 0.125
    baseline = [1] * 4 + [0] * 36
    candidate = [0] * 40
    result = paired_difference(baseline, candidate)
    assert result["p_value"] == pytest.approx(0.125)
    assert result["ci95"][0] < 0 < result["ci95"][1]


def test_exact_mcnemar_by_hand():
    # 8 documents the candidate fixes, 1 it breaks, 11 unchanged: p = 2 * P(X <= 1 | n=9, 1/2) = 2 * 10/512
    delta, interval, p = exact_paired_binary(8, 1, 20)
    assert p == pytest.approx(20 / 512) and delta == pytest.approx(7 / 20)
    assert interval[0] > 0


def test_five_of_five_flips_give_an_honest_interval_not_a_zero_width_one():
    result = paired_difference([0] * 5, [1] * 5)
    assert result["delta"] == 1 and result["p_value"] == pytest.approx(2 / 32)
    low, high = result["ci95"]
    assert high == pytest.approx(1) and low < 0.5  # Clopper-Pearson on 5/5: theta in [0.478, 1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_are_excluded_and_counted_never_p_zero(bad):
    baseline = [1, 0, 1, 0, 1, 0, 1, 0]
    candidate = [1, 1, 1, 0, 1, 0, 0, bad]
    result = paired_difference(baseline, candidate)
    assert result["excluded"] == 1 and result["n"] == 7
    assert math.isfinite(result["delta"]) and result["p_value"] == 1
    continuous = paired_difference([0.1, 0.2, 0.3, 0.4], [0.2, bad, 0.35, 0.5])
    assert continuous["excluded"] == 1 and continuous["p_value"] is None or continuous["p_value"] > 0


@pytest.mark.parametrize("values", [([1.0], [0.0]), ([0.5], [0.7])])
def test_one_document_gives_no_interval_and_no_test(values):
    result = paired_difference(*values)
    assert result["n"] == 1 and result["ci95"] is None and result["p_value"] is None


def test_continuous_differences_without_spread_give_no_interval_and_no_test():
    result = paired_difference([0.1, 0.2, 0.3], [0.2, 0.3, 0.4])
    assert result["ci95"] is None and result["p_value"] is None and result["delta"] == pytest.approx(0.1)


def test_continuous_metrics_t_interval_and_permutation_against_scipy():
    rng = np.random.default_rng(1)
    baseline = rng.normal(size=30)
    candidate = baseline + rng.normal(0.3, 0.5, size=30)
    result = paired_difference(baseline, candidate)
    d = candidate - baseline
    low, high = stats.t.interval(0.95, 29, loc=d.mean(), scale=stats.sem(d))
    assert result["ci95"] == pytest.approx([low, high])
    reference = stats.permutation_test(
        (d,), np.mean, permutation_type="samples", n_resamples=10_000, random_state=0
    ).pvalue
    assert result["p_value"] == pytest.approx(reference, abs=0.02)  # both Monte Carlo on 10,000 sign patterns
    assert paired_difference(baseline, candidate) == result  # fixed seed: reproducible


def test_exact_permutation_p_for_a_small_sample():
    baseline = [0.10, 0.20, 0.30, 0.40, 0.50, 0.60, 0.70, 0.85]
    candidate = [x + 0.05 + 0.01 * i for i, x in enumerate(baseline)]
    result = paired_difference(baseline, candidate)
    # every difference positive: only the all-plus and all-minus sign patterns are as extreme, 2 / 2^8
    assert result["test"] == "paired permutation" and result["p_value"] == pytest.approx(2 / 256)


def test_permutation_test_memory_is_bounded():
    rng = np.random.default_rng(2)
    baseline = rng.normal(size=10_000)
    candidate = baseline + rng.normal(0.0, 1.0, size=10_000)
    tracemalloc.start()
    paired_difference(baseline, candidate)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 200 * 2**20, f"peak {peak / 2**20:.0f} MiB (unbatched: 10,000 x 10,000 float64 = 763 MiB)"


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([1, 0], [1])


def test_seed_interval_by_hand_and_its_edge_cases():
    result = seed_interval([-0.01, 0.02, 0.005])
    mean = 0.005
    sd = math.sqrt(((-0.015) ** 2 + 0.015**2 + 0**2) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2)
    assert result["delta_mean"] == pytest.approx(mean)
    assert result["ci95"] == pytest.approx([mean - half, mean + half])
    assert result["n_seeds"] == 3 and result["excludes_zero"] is False
    assert seed_interval([0.10, 0.11, 0.12])["excludes_zero"] is True
    one = seed_interval([0.1])
    assert one["ci95"] is None and one["excludes_zero"] is None  # one seed says nothing about the spread
    flat = seed_interval([0.05, 0.05, 0.05])
    assert flat["ci95"] is None and flat["excludes_zero"] is None  # no spread: no zero-width "interval"
    assert json.dumps(one)  # summary.json stores it as null, not [d, d]


def test_two_level_bootstrap_combines_seed_and_block_spread():
    rng = np.random.default_rng(3)
    tight = 0.02 + 0.001 * rng.normal(size=(5, 16))  # blocks and seeds agree
    loose = 0.02 + 0.05 * rng.normal(size=(5, 16))  # blocks vary a lot
    a, b = two_level_bootstrap(tight), two_level_bootstrap(loose)
    assert a["excludes_zero"] and a["ci95"][0] > 0
    assert (b["ci95"][1] - b["ci95"][0]) > 10 * (a["ci95"][1] - a["ci95"][0])
    seeds_only = two_level_bootstrap(np.repeat(rng.normal(0.02, 0.05, size=(5, 1)), 16, axis=1))
    assert seeds_only["ci95"][1] - seeds_only["ci95"][0] > 0.01  # the seed spread is in the interval
    assert two_level_bootstrap([[0.1] * 16])["ci95"] is None  # one seed: no interval


def test_holm_matches_statsmodels_and_keeps_missing_tests_missing():
    p = [0.01, 0.04, None, 0.03, 0.5]
    present = [x for x in p if x is not None]
    expected = list(multipletests(present, method="holm")[1])
    got = holm(p)
    assert got[2] is None
    assert [x for x in got if x is not None] == pytest.approx(expected)
    # the demo's twelve tests: the smallest raw p of 0.039 does not survive
    assert holm([0.039] + [0.109, 0.18, 0.289, 0.375, 0.375, 0.607, 1, 1, 1, 1, 1])[0] == pytest.approx(0.468)

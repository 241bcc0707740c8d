"""Paired statistics against hand-computed cases (exact McNemar, t-intervals, the identity case)."""

import math

import pytest

from kha_hf.common.statistics import paired_difference, seed_interval


def test_identical_scores_give_zero_delta_zero_interval_and_p_one():
    scores = [1, 0, 1, 1, 0, 0, 1]
    result = paired_difference(scores, scores)
    assert result["delta"] == 0 and result["ci95"] == [0, 0] and result["p_value"] == 1
    assert result["n"] == 7 and result["discordant"] == 0
    continuous = paired_difference([0.1, 0.5, 2.0], [0.1, 0.5, 2.0])
    assert continuous["ci95"] == [0, 0] and continuous["p_value"] == 1


def test_exact_mcnemar_by_hand():
    # 8 documents the candidate fixes, 1 it breaks, 11 unchanged: p = 2 * P(X <= 1 | n=9, 1/2) = 2 * 10/512
    baseline = [0] * 8 + [1] + [1] * 6 + [0] * 5
    candidate = [1] * 8 + [0] + [1] * 6 + [0] * 5
    result = paired_difference(baseline, candidate)
    assert result["test"] == "exact McNemar" and result["discordant"] == 9
    assert result["p_value"] == pytest.approx(20 / 512)
    assert result["delta"] == pytest.approx(7 / 20)
    # standard error of the 20 per-document differences (8 ones, 1 minus one, 11 zeros)
    d = [1] * 8 + [-1] + [0] * 11
    mean = sum(d) / 20
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 19 / 20)
    assert result["stderr"] == pytest.approx(se)
    t975_19 = 2.093024054408263
    assert result["ci95"] == pytest.approx([mean - t975_19 * se, mean + t975_19 * se])


def test_mcnemar_is_symmetric_and_one_sided_balance_is_not_significant():
    a, b = [1, 1, 0, 0], [0, 0, 1, 1]
    assert paired_difference(a, b)["p_value"] == 1
    forward = paired_difference([0] * 10, [1] * 10)
    backward = paired_difference([1] * 10, [0] * 10)
    assert forward["p_value"] == backward["p_value"] == pytest.approx(2 / 1024)


def test_continuous_metrics_use_a_seeded_permutation_test():
    baseline = [0.10, 0.20, 0.30, 0.40, 0.50, 0.60, 0.70, 0.80]
    candidate = [x + 0.05 for x in baseline]
    result = paired_difference(baseline, candidate)
    assert result["test"] == "paired permutation"
    assert result["delta"] == pytest.approx(0.05)
    # every difference is positive: only the all-plus and all-minus sign patterns are as extreme, 2 / 2^8
    assert result["p_value"] == pytest.approx(2 / 256)
    assert paired_difference(baseline, candidate) == result  # fixed seed: reproducible


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([1, 0], [1])


def test_seed_interval_by_hand():
    result = seed_interval([-0.01, 0.02, 0.005])
    mean = 0.005
    sd = math.sqrt(((-0.015) ** 2 + 0.015**2 + 0**2) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2)
    assert result["delta_mean"] == pytest.approx(mean)
    assert result["ci95"] == pytest.approx([mean - half, mean + half])
    assert result["n_seeds"] == 3 and not result["excludes_zero"]
    assert seed_interval([0.10, 0.11, 0.12])["excludes_zero"]
    assert not seed_interval([0.1])["excludes_zero"]  # one seed says nothing about the spread

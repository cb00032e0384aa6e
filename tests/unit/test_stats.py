"""The statistics a table's verdicts rest on, checked against hand computations (no engine)."""
from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from harness.analysis.stats import (EXACT_UP_TO, RESAMPLES, benjamini_hochberg, bca_interval, detectable_difference,
                           flips_for, holm, intervals, sign_flip_p)


def test_sign_flips_give_the_exact_permutation_p_value():
    # Four equal positive differences: of the 16 sign patterns, 2 are as extreme (all +, all -).
    assert sign_flip_p({"t": np.ones(4)}) == pytest.approx(2 / 16, abs=0.01)
    assert sign_flip_p({"t": np.zeros(5)}) == 1.0
    # Tasks are averaged: a task that differs in both directions dilutes a consistent one.
    assert sign_flip_p({"a": np.ones(8), "b": np.array([1.0, -1.0] * 4)}) > sign_flip_p({"a": np.ones(8)})
    assert sign_flip_p({"a": np.ones(8)}) == pytest.approx(2 / 256, abs=0.003)


def test_holm_and_benjamini_hochberg_adjust_as_published():
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and benjamini_hochberg([0.5, 0.9]) == pytest.approx([0.9, 0.9])


def test_bca_equals_the_textbook_formula_on_one_task():
    rng = np.random.default_rng(7)
    scores = (rng.random(20) < 0.2).astype(float)  # skewed 0/1 scores, as at 20 samples per task
    interval = bca_interval({"t": scores})
    # Written out: the bootstrap's draws (seed 0), z0 from their share below the estimate, the
    # acceleration from the jackknife of the mean.
    draws = 100 * scores[np.random.default_rng(0).integers(0, 20, size=(RESAMPLES, 20))].mean(axis=1)
    estimate = 100 * scores.mean()
    normal = NormalDist()
    z0 = normal.inv_cdf((np.sum(draws < estimate) + 0.5 * np.sum(draws == estimate)) / RESAMPLES)
    jack = np.array([100 * np.delete(scores, i).mean() for i in range(20)])
    d = jack.mean() - jack
    a = np.sum(d ** 3) / (6 * np.sum(d ** 2) ** 1.5)
    levels = [100 * normal.cdf(z0 + (z0 + z) / (1 - a * (z0 + z))) for z in (normal.inv_cdf(0.025), normal.inv_cdf(0.975))]
    low, high = np.percentile(draws, levels)
    assert (interval.low, interval.high) == (round(low, 2), round(high, 2))
    percentile = intervals({"t": scores})[1]
    assert interval.estimate == percentile.estimate and (interval.low, interval.high) != (percentile.low, percentile.high)
    assert bca_interval({"t": np.zeros(20)}).low == bca_interval({"t": np.zeros(20)}).high == 0.0


def test_the_detectable_difference_follows_the_standard_error():
    differences = np.array([0.0, 1.0] * 10)  # variance 0.263 (ddof 1), n = 20
    expected = (NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.8)) * np.sqrt(np.var(100 * differences, ddof=1) / 20)
    assert detectable_difference({"t": differences}) == pytest.approx(expected)
    assert detectable_difference({"a": differences, "b": differences}) == pytest.approx(expected / np.sqrt(2))


def test_few_non_zero_differences_give_the_exact_permutation_p_value():
    # Differences 3, 1, 1 (and zeros, which cannot change sign): of the 8 sign patterns the sums
    # are +-5, +-3 (twice each side), +-1 (twice): |sum| >= 5 for 2 patterns.
    assert sign_flip_p({"t": np.array([3.0, 1.0, 1.0, 0.0, 0.0])}) == 2 / 8
    # Against the observed 3 (differences 3, 1, -1): |sum| >= 3 for the 2 patterns at +-5 and 4 at +-3.
    assert sign_flip_p({"t": np.array([3.0, 1.0, -1.0])}) == 6 / 8
    # Tasks weigh their samples by 1 / (tasks x samples): 2 in a task of 2 samples outweighs 1 in a task of 1.
    assert sign_flip_p({"a": np.array([2.0, 0.0]), "b": np.array([-1.0])}) == 1.0
    assert sign_flip_p({"a": np.array([2.0, 0.0]), "b": np.array([0.5])}) == 2 / 4
    # Negating every difference (B minus A instead of A minus B) changes nothing.
    rng = np.random.default_rng(3)
    d = {"a": rng.normal(0.2, 1, 30), "b": rng.normal(0, 1, 25)}
    assert sign_flip_p(d) == sign_flip_p({t: -v for t, v in d.items()})


def test_random_flips_agree_with_the_full_enumeration():
    rng = np.random.default_rng(11)
    values = rng.normal(0.3, 1, EXACT_UP_TO + 2)  # just past exact enumeration: random flips
    patterns = np.arange(2 ** len(values))[:, None] >> np.arange(len(values)) & 1
    exact = np.mean(np.abs((2 * patterns - 1) @ values) >= abs(values.sum()) * (1 - 1e-9))
    p = sign_flip_p({"t": values}, flips=20_000)
    assert p == pytest.approx(exact, abs=4 * np.sqrt(exact * (1 - exact) / 20_000))
    assert p != exact  # it did sample
    assert flips_for(10) == 10_000 and flips_for(234) == 23_400 and 234 / (flips_for(234) + 1) < 0.01


def test_bca_works_on_any_scale_and_negates_exactly():
    rng = np.random.default_rng(5)
    d = {"a": rng.normal(-0.4, 0.3, 20) ** 3, "b": rng.normal(0.1, 0.5, 20)}  # skewed
    points, natural = bca_interval(d), bca_interval(d, scale=1)
    assert (natural.low, natural.high) == pytest.approx((points.low / 100, points.high / 100), abs=0.006)
    flipped = bca_interval({t: -v for t, v in d.items()})
    assert (flipped.low, flipped.high) == (points.negated().low, points.negated().high)
    assert flipped.estimate == points.negated().estimate
    # Skewed data: BCa moves the interval away from the percentile one.
    assert (points.low, points.high) != (intervals(d)[1].low, intervals(d)[1].high)
    assert detectable_difference(d, scale=1) == pytest.approx(detectable_difference(d) / 100)


def test_bca_counts_draws_equal_to_the_estimate_up_to_rounding_as_ties():
    """0.1 is no binary fraction: resampled means equal to the estimate differ from it in the
    last bits, and counting them as below or above would shift the bias correction."""
    from harness.analysis.stats import bca_interval

    values = np.array([0.1, 0.0, 0.1, 0.1, 1.0])
    exact = bca_interval({"t": values})
    scaled = bca_interval({"t": values * 10}, scale=10)  # the same data in exact binary fractions
    assert (exact.low, exact.high) == pytest.approx((scaled.low, scaled.high), abs=0.05)

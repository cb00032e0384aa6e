"""The statistics a table's verdicts rest on, checked against hand computations (no engine)."""
from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from harness.stats import (RESAMPLES, benjamini_hochberg, bca_interval, detectable_difference, holm, intervals,
                           sign_flip_p)


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

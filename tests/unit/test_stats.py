"""The statistics a table's verdicts rest on, checked against hand computations (no engine)."""
from __future__ import annotations

import math
import time
from statistics import NormalDist

import numpy as np
import pytest

from harness.analysis.stats import (FLIPS, RESAMPLES, benjamini_hochberg, bca_interval, data_seed, detectable_difference, holm,
                                    sign_flip_test)

NORMAL = NormalDist()


def test_holm_and_benjamini_hochberg_adjust_as_published():
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and benjamini_hochberg([0.5, 0.9]) == pytest.approx([0.9, 0.9])


def bca_by_hand(distribution: np.ndarray, probabilities: np.ndarray, estimate: float, jackknife: np.ndarray
                ) -> tuple[float, float]:
    """Efron's BCa written out on a discrete bootstrap distribution (values, probabilities)."""
    z0 = NORMAL.inv_cdf(probabilities[distribution < estimate - 1e-9].sum()
                        + 0.5 * probabilities[np.abs(distribution - estimate) <= 1e-9].sum())
    d = jackknife.mean() - jackknife
    a = np.sum(d ** 3) / (6 * np.sum(d ** 2) ** 1.5)
    levels = [NORMAL.cdf(z0 + (z0 + z) / (1 - a * (z0 + z))) for z in (NORMAL.inv_cdf(0.025), NORMAL.inv_cdf(0.975))]
    order = np.argsort(distribution)
    cumulative = np.cumsum(probabilities[order])
    return tuple(float(distribution[order][np.argmax(cumulative >= level)]) for level in levels)


def test_bca_of_0_1_scores_is_computed_from_the_exact_binomial_bootstrap_distribution():
    rng = np.random.default_rng(7)
    scores = (rng.random(20) < 0.2).astype(float)  # skewed 0/1 scores, as at 20 samples per task
    interval = bca_interval({"t": scores})
    # Resampling 20 0/1 scores: the number of ones is binomial(20, share of ones).
    share = scores.mean()
    ones = np.arange(21)
    probabilities = np.array([math.comb(20, j) * share ** j * (1 - share) ** (20 - j) for j in ones])
    jackknife = np.array([100 * np.delete(scores, i).mean() for i in range(20)])
    low, high = bca_by_hand(100 * ones / 20, probabilities, 100 * share, jackknife)
    assert (interval.low, interval.high) == (round(low, 2), round(high, 2))
    assert (interval.mc_error, interval.resamples) == (0.0, 0)  # nothing drawn: no Monte Carlo error
    # BCa is not the percentile interval here: the skew moves it.
    cumulative = np.cumsum(probabilities)
    percentile = (5 * np.argmax(cumulative >= 0.025), 5 * np.argmax(cumulative >= 0.975))
    assert (interval.low, interval.high) != percentile
    assert bca_interval({"t": np.zeros(20)}).low == bca_interval({"t": np.zeros(20)}).high == 0.0


def test_bca_from_resamples_equals_the_textbook_formula():
    """Continuous values (too many distinct resamples to compute the distribution): RESAMPLES
    draws from a generator seeded by the data, z0 from their share below the estimate, the
    acceleration from the jackknife, the draws' percentiles."""
    values = np.random.default_rng(8).gamma(0.8, 0.3, 20)  # skewed
    interval = bca_interval({"t": values}, resamples=RESAMPLES, max_resamples=RESAMPLES)
    rng = np.random.default_rng(data_seed("bootstrap", [values], ("t",)))
    draws = 100 * values[rng.integers(0, 20, size=(RESAMPLES, 20))].mean(axis=1)
    estimate = 100 * values.mean()
    z0 = NORMAL.inv_cdf((np.sum(draws < estimate) + 0.5 * np.sum(draws == estimate)) / RESAMPLES)
    jackknife = np.array([100 * np.delete(values, i).mean() for i in range(20)])
    d = jackknife.mean() - jackknife
    a = np.sum(d ** 3) / (6 * np.sum(d ** 2) ** 1.5)
    levels = [100 * NORMAL.cdf(z0 + (z0 + z) / (1 - a * (z0 + z))) for z in (NORMAL.inv_cdf(0.025), NORMAL.inv_cdf(0.975))]
    low, high = np.percentile(draws, levels)
    assert (interval.low, interval.high, interval.resamples) == (round(low, 2), round(high, 2), RESAMPLES)
    assert interval.mc_error > 0


def test_the_detectable_difference_follows_the_standard_error():
    differences = np.array([0.0, 1.0] * 10)  # variance 0.263 (ddof 1), n = 20
    expected = (NORMAL.inv_cdf(0.975) + NORMAL.inv_cdf(0.8)) * np.sqrt(np.var(100 * differences, ddof=1) / 20)
    assert detectable_difference({"t": differences}) == pytest.approx(expected)
    assert detectable_difference({"a": differences, "b": differences}) == pytest.approx(expected / np.sqrt(2))


def test_bootstrap_monte_carlo_error_falls_with_resamples_and_meets_its_target():
    rng = np.random.default_rng(9)
    d = {"a": rng.normal(0.1, 0.3, 20), "b": rng.gamma(0.5, 0.4, 20)}  # continuous: drawn, not computed
    errors = [bca_interval(d, resamples=n, max_resamples=n).mc_error for n in (10_000, 40_000, 160_000)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < errors[0] / 2.5  # about 1/sqrt(resamples)
    adaptive = bca_interval(d)
    assert adaptive.mc_error < 0.1 and adaptive.resamples >= RESAMPLES
    tight = bca_interval(d, target=0.03)
    assert tight.mc_error < 0.03 and tight.resamples > adaptive.resamples
    natural = bca_interval(d, scale=1)  # a quantity in its own units: 0.01 by default
    assert natural.mc_error < 0.01
    assert (natural.low, natural.high) == pytest.approx((adaptive.low / 100, adaptive.high / 100), abs=0.03)


def test_the_reported_bootstrap_error_is_the_spread_of_bounds_over_independent_draws():
    """Sectioning is honest: intervals of the same data drawn with 20 different seeds (a change in
    the 16th digit of one value gives another seed) scatter by about the error each reports."""
    rng = np.random.default_rng(10)
    values = rng.gamma(0.8, 0.3, 40)
    lows, errors = [], []
    for i in range(20):
        nudged = values.copy()
        nudged[0] = nudged[0] * (1 + (i + 1) * 1e-15)
        interval = bca_interval({"t": nudged}, digits=6, resamples=RESAMPLES, max_resamples=RESAMPLES)
        lows.append(interval.low)
        errors.append(interval.mc_error)
    assert len(set(lows)) == 20, "different data, different draws"
    assert 0.5 < np.std(lows, ddof=1) / np.median(errors) < 2
    assert bca_interval({"t": values}) == bca_interval({"t": values}), "the same data, the same draws"


def test_bca_works_on_any_scale_and_negates_exactly():
    rng = np.random.default_rng(5)
    d = {"a": rng.normal(-0.4, 0.3, 20) ** 3, "b": rng.normal(0.1, 0.5, 20)}  # skewed
    points, natural = bca_interval(d), bca_interval(d, scale=1)
    assert (natural.low, natural.high) == pytest.approx((points.low / 100, points.high / 100), abs=0.03)
    flipped = bca_interval({t: -v for t, v in d.items()})
    negated = points.negated()
    assert (flipped.low, flipped.high, flipped.estimate) == (negated.low, negated.high, negated.estimate)
    assert (flipped.mc_error, flipped.resamples) == (negated.mc_error, negated.resamples)
    assert detectable_difference(d, scale=1) == pytest.approx(detectable_difference(d) / 100)


def test_bca_counts_draws_equal_to_the_estimate_up_to_rounding_as_ties():
    """0.1 is no binary fraction: resampled means equal to the estimate differ from it in the
    last bits, and counting them as below or above would shift the bias correction."""
    from harness.analysis.stats import _share_below

    # 0.1 + 0.2 is 0.30000000000000004: a tie with 0.3, counted half like the exact one.
    assert _share_below(np.array([0.1 + 0.2, 0.3, 0.2, 0.4]), 0.3) == 0.5
    assert _share_below(np.array([0.1 + 0.2, 0.3, 0.2, 0.4]), 0.3, np.array([0.4, 0.1, 0.1, 0.4])) == 0.35
    values = np.array([0.1, 0.0, 0.1, 0.1, 1.0])
    exact = bca_interval({"t": values})
    scaled = bca_interval({"t": values * 10}, scale=10)  # the same data in exact binary fractions
    assert (exact.low, exact.high) == pytest.approx((scaled.low, scaled.high), abs=0.05)


# ---------------------------------------------------------------- intervals that invert their test (issue 51)
def test_random_pattern_bounds_carry_their_monte_carlo_error():
    from harness.analysis.stats import inverted_interval

    rng = np.random.default_rng(7)
    d = {f"t{i}": rng.choice([-1.0, 0.0, 1.0, 0.25], size=30) for i in range(3)}
    p = sign_flip_test(d)
    interval = inverted_interval(d, p)
    assert interval.resamples >= FLIPS and 0 < interval.mc_error < 0.1
    assert interval.significant == (p.p < 0.05)
    again = inverted_interval(d, p)
    assert again == interval  # seeded by the data: a rerun draws the same
    negated = inverted_interval({t: -v for t, v in d.items()}, p)
    assert (negated.low, negated.high) == pytest.approx((-interval.high, -interval.low), abs=4 * interval.mc_error)


def test_a_clustered_cell_interval_counts_clusters_not_samples():
    """A cell's interval with clusters inverts the one-sample test over whole clusters: eight
    clusters of five identical answers give the interval of the eight cluster means, not of 40
    independent samples (a bootstrap over so few clusters would be far too narrow)."""
    from harness.analysis.stats import cell_interval, inverted_interval

    means = np.array([0, 1, 0, 1, 1, 0, 0.5, 1.0])
    values = np.repeat(means, 5)
    labels = np.repeat([f"c{i}" for i in range(8)], 5)
    clustered = cell_interval({"t": values}, clusters={"t": labels})
    alone = inverted_interval({"t": means}, sign_flip_test({"t": means}))
    assert (clustered.estimate, clustered.low, clustered.high) == (alone.estimate, alone.low, alone.high)
    assert clustered.samples == 40 and clustered.resamples == 0  # 8 clusters: exact
    independent = cell_interval({"t": values})
    assert clustered.high - clustered.low > independent.high - independent.low


def test_a_cell_interval_stays_inside_the_values_range_and_is_the_whole_range_where_clusters_cannot_bound_it():
    """Scores lie in [0, 1], their differences in [-1, 1]. results/shared_context's first questions
    for PagedEviction compressing the context (four contexts per task, one question each): one task
    scores 0 everywhere, the other 0, 0.25, 0, 0.25. Two of the 16 sign patterns of the second make
    every flipped deviation agree, with no spread: the studentized draws are infinite in 1/8 of the
    patterns and the clustered interval is (-inf, inf). Intersected with the range it is [0, 100]:
    it says nothing, and reads so. Near zero the symmetric interval goes below 0; where the range
    does not bind, nothing changes."""
    from harness.analysis.stats import cell_interval, inverted_interval

    first = {"key_retrieval": np.zeros(4), "multi_doc_qa": np.array([0.0, 0.25, 0.0, 0.25])}
    contexts = {"key_retrieval": np.array(["k0", "k1", "k2", "k3"]), "multi_doc_qa": np.array(["m0", "m1", "m2", "m3"])}
    unbounded = cell_interval(first, clusters=contexts)
    assert unbounded.low == -math.inf and unbounded.high == math.inf
    whole = cell_interval(first, clusters=contexts, bounds=(0.0, 1.0))
    assert (whole.estimate, whole.low, whole.high) == (6.25, 0.0, 100.0)
    difference = inverted_interval(first, sign_flip_test(first, clusters=contexts), clusters=contexts,
                                   bounds=(-1.0, 1.0))
    assert (difference.low, difference.high) == (-100.0, 100.0)
    near_zero = {"t": np.array([0.0, 0.0, 0.05, 0.0, 0.0, 0.6, 0.0, 0.0])}
    eight = {"t": np.array([f"c{i}" for i in range(8)])}
    free = cell_interval(near_zero, clusters=eight)
    assert free.low < 0 < free.high < 100  # what the range repairs
    clipped = cell_interval(near_zero, clusters=eight, bounds=(0.0, 1.0))
    assert (clipped.estimate, clipped.low, clipped.high) == (free.estimate, 0.0, free.high)
    inside = {"t": np.array([0.4, 0.5, 0.6, 0.55, 0.45, 0.5, 0.6, 0.4])}
    assert cell_interval(inside, clusters=eight, bounds=(0.0, 1.0)) == cell_interval(inside, clusters=eight)
    assert cell_interval(inside, bounds=(0.0, 1.0)) == cell_interval(inside)  # BCa: inside already


# ---------------------------------------------------------------- the sign-flip test's fast paths give the same numbers
def test_numpy_sums_fewer_than_8_strata_left_to_right():
    """``_Stratified.draw`` adds its strata's columns one after another, left to right, instead of
    np.sum over the last axis of a (patterns x strata) array: the same numbers, bit for bit, at a
    fraction of the cost, because that is numpy's order for fewer than 8 (its pairwise sum unrolls
    from 8 on, and draw keeps np.sum there). A numpy that sums otherwise fails here."""
    rng = np.random.default_rng(3)
    for strata in range(1, 8):
        for rows in (1, 3, 1000, 1 << 14):
            a = rng.standard_normal((rows, strata)) * 10.0 ** rng.integers(-8, 8, (rows, strata))
            by_columns = a[:, 0]
            for s in range(1, strata):
                by_columns = by_columns + a[:, s]
            assert np.sum(a, axis=1).tobytes() == by_columns.tobytes(), (strata, rows)


@pytest.mark.parametrize("tasks", [1, 4, 9])
def test_pair_tables_draw_the_very_numbers_the_single_look_ups_do(tasks):
    """A draw of at least eight blocks looks a stratum's first two byte groups up in one 65,536-entry
    table; shorter draws look each group up alone. Both give every |Z*| bit for bit (9 tasks: the
    np.sum path)."""
    from harness.analysis.stats import _FLIP_ROWS, _Stratified

    rng = np.random.default_rng(tasks)
    per_task = {f"t{t}": rng.normal(0.2, 1, 21 + t) for t in range(tasks)}
    at_once, in_steps = _Stratified(per_task), _Stratified(per_task)
    at_once.draw(9 * _FLIP_ROWS)
    while in_steps.flips < 9 * _FLIP_ROWS:
        in_steps.draw(in_steps.flips + _FLIP_ROWS)  # one block a call: no pair tables
    assert np.concatenate(at_once.draws).tobytes() == np.concatenate(in_steps.draws).tobytes()
    assert at_once.result() == in_steps.result()


def test_the_interval_read_from_its_p_values_tail_is_the_interval_drawn_again(monkeypatch):
    """``inverted_interval`` reads its critical values from the tail of the p-value's own draws
    (``PValue.test``) instead of drawing the same patterns again: the same interval as drawing
    them again, also where the tail holds too few draws (it then draws them again) and where the
    p-value belongs to other data (its test is not used)."""
    from dataclasses import replace

    from harness.analysis import stats
    from harness.analysis.stats import inverted_interval, settled_p_values

    rng = np.random.default_rng(5)
    per_task = {"a": rng.normal(0.3, 1, 30), "b": rng.normal(0.1, 1, 26)}
    other = {"a": rng.normal(0.0, 1, 30), "b": rng.normal(0.2, 1, 26)}
    p = sign_flip_test(per_task)
    assert p.test is not None and p.test.tail_critical(0.05, 0, p.flips) is not None, "the tail holds the critical value"
    again = inverted_interval(per_task, replace(p, test=None))
    assert again.resamples >= FLIPS
    assert inverted_interval(per_task, p) == again
    family = settled_p_values([per_task, other])
    assert inverted_interval(per_task, family[0]) == again
    assert inverted_interval(other, p) == inverted_interval(other, replace(p, test=None))  # p of other data
    monkeypatch.setattr(stats, "TAIL_FROM", 50.0)  # a tail holding no draw
    short = sign_flip_test(per_task)
    assert short.test.tail_critical(0.05, 0, short.flips) is None
    assert inverted_interval(per_task, short) == again

"""The statistics a table's verdicts rest on, checked against hand computations (no engine)."""
from __future__ import annotations

import math
import time
from statistics import NormalDist

import numpy as np
import pytest

from harness.analysis.stats import (EXACT_UP_TO, FLIPS, RESAMPLES, _enumerated_p, _weighted, benjamini_hochberg,
                                    bca_interval, data_seed, detectable_difference, holm, settled_p_values,
                                    sign_flip_p, sign_flip_test)

NORMAL = NormalDist()


def brute_force_p(per_task: dict[str, np.ndarray]) -> float:
    """Every one of the 2^k sign patterns of the non-zero weighted differences, written out."""
    weighted = _weighted(per_task)
    patterns = np.arange(2 ** len(weighted))[:, None] >> np.arange(len(weighted)) & 1
    return float(np.mean(np.abs((2 * patterns - 1) @ weighted) >= abs(weighted.sum()) * (1 - 1e-9)))


def exact_p(per_task: dict[str, np.ndarray]) -> float:
    """The exact p-value by meet in the middle, at any k (sign_flip_test switches to random flips
    above EXACT_UP_TO; this does not)."""
    weighted = _weighted(per_task)
    return _enumerated_p(weighted, abs(weighted.sum()) * (1 - 1e-9))


def test_sign_flips_give_the_exact_permutation_p_value():
    # Four equal positive differences: of the 16 sign patterns, 2 are as extreme (all +, all -).
    assert sign_flip_p({"t": np.ones(4)}) == 2 / 16
    assert sign_flip_p({"t": np.zeros(5)}) == 1.0
    # Tasks are averaged: a task that differs in both directions dilutes a consistent one.
    assert sign_flip_p({"a": np.ones(8), "b": np.array([1.0, -1.0] * 4)}) > sign_flip_p({"a": np.ones(8)})
    assert sign_flip_p({"a": np.ones(8)}) == 2 / 256
    exact = sign_flip_test({"a": np.ones(8)})
    assert (exact.flips, exact.se, exact.bounds()) == (0, 0.0, (2 / 256, 2 / 256))


def test_meet_in_the_middle_counts_what_brute_force_enumeration_counts():
    """Random differences at every k up to 14 (one task and two of unequal size), and ties: equal
    differences (0/1 scores), a lattice where many sign patterns give the observed sum exactly, and
    repeated continuous values. Exactly equal, not approximately: both count patterns."""
    rng = np.random.default_rng(0)
    cases = []
    for k in range(1, 15):
        first, second = k - k // 2, max(1, k // 2)  # two tasks of unequal size, k differences in all (about)
        cases.append({"t": rng.normal(0.3, 1, k)})
        cases.append({"a": rng.normal(0.2, 1, first), "b": rng.normal(0, 1, second)})
        cases.append({"t": rng.choice([-1.0, 1.0], k)})  # ties: every difference the same size
        cases.append({"a": rng.choice([-1.0, 0.0, 1.0], first), "b": rng.choice([-0.5, 0.5, 1.0], second)})  # a lattice
        cases.append({"t": np.repeat(rng.normal(0.2, 1, 3), k)[:k]})  # repeated continuous values
    checked = 0
    for case in cases:
        if not _weighted(case).sum():
            continue  # no difference: p = 1 without enumeration
        assert sign_flip_test(case).flips == 0
        assert sign_flip_p(case) == brute_force_p(case), case
        checked += 1
    assert checked > 60
    # 0/1 differences, 20 of +1 and 8 of -1 at 20 samples per task: the binomial tail, exactly.
    case = {"a": np.array([1.0] * 14 + [-1.0] * 6), "b": np.array([1.0] * 6 + [-1.0] * 2 + [0.0] * 12)}
    tail = sum(math.comb(28, j) for j in range(28 + 1) if abs(2 * j - 28) >= 12) / 2 ** 28
    assert sign_flip_p(case) == pytest.approx(tail, rel=1e-12)


def test_enumeration_stays_cheap_up_to_where_random_flips_take_over():
    values = np.random.default_rng(2).normal(0.2, 1, EXACT_UP_TO)
    start = time.perf_counter()
    result = sign_flip_test({"t": values})
    assert result.flips == 0 and time.perf_counter() - start < 5  # about 0.1 s
    assert sign_flip_test({"t": np.append(values, 0.5)}).flips == FLIPS  # one more: random flips


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


def test_few_non_zero_differences_give_the_exact_permutation_p_value():
    # Differences 3, 1, 1 (and zeros, which cannot change sign): of the 8 sign patterns the sums
    # are +-5, +-3 (twice each side), +-1 (twice): |sum| >= 5 for 2 patterns.
    assert sign_flip_p({"t": np.array([3.0, 1.0, 1.0, 0.0, 0.0])}) == 2 / 8
    # Against the observed 3 (differences 3, 1, -1): |sum| >= 3 for the 2 patterns at +-5 and 4 at +-3.
    assert sign_flip_p({"t": np.array([3.0, 1.0, -1.0])}) == 6 / 8
    # Tasks weigh their samples by 1 / (tasks x samples): 2 in a task of 2 samples outweighs 1 in a task of 1.
    assert sign_flip_p({"a": np.array([2.0, 0.0]), "b": np.array([-1.0])}) == 1.0
    assert sign_flip_p({"a": np.array([2.0, 0.0]), "b": np.array([0.5])}) == 2 / 4
    # Negating every difference (B minus A instead of A minus B) changes nothing, exact or random.
    rng = np.random.default_rng(3)
    d = {"a": rng.normal(0.2, 1, 30), "b": rng.normal(0, 1, 25)}
    assert sign_flip_test(d).flips == FLIPS
    assert sign_flip_test(d) == sign_flip_test({t: -v for t, v in d.items()})


def test_random_flips_agree_with_the_exact_p_value_within_their_reported_error():
    rng = np.random.default_rng(11)
    values = {"t": rng.normal(0.3, 1, EXACT_UP_TO + 2)}  # just past exact enumeration: random flips
    exact = exact_p(values)
    for flips in (10_000, 100_000, 1_000_000):
        result = sign_flip_test(values, flips)
        assert result.flips == flips and result.p != exact  # it did sample
        assert result.se == pytest.approx(math.sqrt(result.p * (1 - result.p) / flips))
        assert abs(result.p - exact) < 4 * result.se
        low, high = result.bounds()
        assert low < exact < high
    # The first N patterns are the same however the drawing is split: N flips, one p.
    from harness.analysis.stats import _SignFlips

    split = _SignFlips(values)
    split.draw(30_000)
    split.draw(100_000)
    assert split.result() == sign_flip_test(values, 100_000)


def test_each_comparison_draws_its_own_patterns_and_reruns_draw_the_same():
    """The shared seed made every comparison's Monte Carlo error move together. Reordering the
    differences leaves the exact p-value as it is but changes the data's bytes: each order draws
    its own patterns, so their p-values scatter around the exact one by about their standard
    error, while the same data gives the same p-value every time."""
    rng = np.random.default_rng(12)
    values = rng.normal(0.25, 1, EXACT_UP_TO + 2)
    exact = exact_p({"t": values})
    orders = [{"t": rng.permutation(values)} for _ in range(12)]
    results = [sign_flip_test(order) for order in orders]
    assert len({data_seed("sign flips", [order["t"]]) for order in orders}) == len(orders)
    assert len({result.p for result in results}) > 8, "different data, different draws"
    errors = np.array([(result.p - exact) / result.se for result in results])
    assert 0.3 < errors.std() < 3 and abs(errors.mean()) < 2, "independent errors of about one standard error"
    assert [sign_flip_test(order) for order in orders] == results, "the same data, the same draws"


def family_straddling_holm() -> tuple[list[dict[str, np.ndarray]], float]:
    """Ten comparisons, and the exact p of the first: of 44 differences (random flips), its exact p
    about 0.0044, so that Holm's first step compares it with 0.05/10 = 0.005; the second of 50
    differences with a p-value far above any level (random flips too); eight with no difference
    (p = 1, exact)."""
    rng = np.random.default_rng(21)
    base = rng.normal(0, 1, 44)
    close = {"t": base - base.mean() + 0.445}
    noise = rng.normal(0, 1, 50)
    far = {"t": noise - noise.mean() + 0.02}
    return [close, far] + [{"t": np.zeros(20)}] * 8, exact_p(close)


def test_a_p_value_whose_holm_decision_straddles_the_level_is_refined_until_settled():
    family, exact = family_straddling_holm()
    assert 0.004 < exact < 0.0048  # Holm: 10 x exact < 0.05, rejected
    first = sign_flip_test(family[0], FLIPS)
    low, high = first.bounds()
    assert low < 0.005 < high, "the constructed case: 10,000 flips cannot tell"
    values = settled_p_values(family, alpha=0.05)
    refined = values[0]
    assert refined.settled and refined.flips > FLIPS and refined.flips <= 10_000_000
    low, high = refined.bounds()
    assert high < 0.005 and abs(refined.p - exact) < 4 * refined.se  # decided, and right
    assert holm([v.p for v in values])[0] < 0.05 and benjamini_hochberg([v.p for v in values])[0] < 0.05
    assert values[1].p > 0.5 and values[1].flips == FLIPS, "a p-value no mark depends on is not refined"
    assert all(v.flips == 0 and v.p == 1.0 for v in values[2:]), "exact p-values are left alone"
    # Capped below what it needs, the decision stays unsettled and says so.
    capped = settled_p_values(family, alpha=0.05, max_flips=FLIPS)
    assert not capped[0].settled and capped[0].flips == FLIPS and all(v.settled for v in capped[1:])
    assert settled_p_values([], alpha=0.05) == []


def test_a_holm_decision_is_settled_even_where_benjamini_hochberg_is():
    """The same close p-value next to an exact p of 10/1024 = 0.0098: BH rejects both wherever the
    close one lies below 0.0098 (0.0098 <= 0.05 x 2/10), so only Holm's decision about it
    (10 x p against 0.05) is open, and that alone must get it refined."""
    family, exact = family_straddling_holm()
    family[1] = {"t": np.array([-1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])}
    assert sign_flip_p(family[1]) == 10 / 1024
    first = settled_p_values(family, alpha=0.05, max_flips=FLIPS)
    assert not first[0].settled and first[0].bounds()[1] < 10 / 1024 and first[1].settled
    assert benjamini_hochberg([v.p for v in first])[:2] == pytest.approx([0.0488, 0.0488], abs=1e-4)
    values = settled_p_values(family, alpha=0.05)
    assert values[0].settled and values[0].flips > FLIPS and values[0].bounds()[1] < 0.005
    assert values[1].p == 10 / 1024 and values[1].flips == 0


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
def shifted_p(per_task: dict[str, np.ndarray], shift: float) -> float:
    """The exact sign-flip p of the differences minus ``shift`` (raw units), every sample counted."""
    from harness.analysis.stats import _units

    values, weights = _units(per_task)
    shifted = values - shift * weights
    return _enumerated_p(shifted, abs(shifted.sum()) * (1 - 1e-9))


def test_the_interval_excludes_zero_exactly_when_its_test_rejects():
    """Over many small tables, exact and random, near the threshold and far from it: the interval
    built from a comparison's own p-value never disagrees with it. BCa did, in 5% of the committed
    average-level comparisons."""
    from harness.analysis.stats import inverted_interval

    rng = np.random.default_rng(51)
    seen = {True: 0, False: 0}
    for case in range(120):
        tasks, n = (1, int(rng.integers(6, 20))) if case % 3 else (4, int(rng.integers(12, 30)))
        shift = rng.choice([0.0, 0.1, 0.3])
        d = {f"t{i}": rng.choice([-1.0, 0.0, 0.0, 1.0, 0.5], size=n) + shift * (rng.random(n) < 0.5) for i in range(tasks)}
        p = sign_flip_test(d)
        interval = inverted_interval(d, p)
        assert interval.significant == (p.p < 0.05), (d, p, interval)
        seen[p.p < 0.05] += 1
    assert min(seen.values()) >= 10, seen  # both verdicts exercised


def test_exact_bounds_are_where_the_shifted_test_starts_rejecting():
    """With at most EXACT_UP_TO samples the bounds are exact: just inside a bound the test of the
    shifted differences does not reject, just outside it does."""
    from harness.analysis.stats import inverted_interval

    d = {"a": np.array([1, 1, 0, 1, 0.5, 0, 1, 1, -1, 1.0]), "b": np.array([0, 1, 1, 0.5, 1, 1, 0, -0.5, 1, 1.0])}
    interval = inverted_interval(d, sign_flip_test(d), digits=6)
    assert interval.resamples == 0 and interval.low > 0  # p = 0.0039: rejects zero
    for bound, outward in ((interval.low, -1), (interval.high, 1)):
        assert shifted_p(d, (bound - outward * 1e-4) / 100) >= 0.05
        assert shifted_p(d, (bound + outward * 1e-4) / 100) < 0.05


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


def test_zero_is_judged_by_the_reported_p_value():
    """The bracket starts from the p-value the table prints: a p just under 0.05 excludes zero, the
    same data with a p just over it (as a random p could be) includes it."""
    from harness.analysis.stats import PValue, inverted_interval

    d = {"t": np.array([1.0, 1, 1, 1, 1, 0, 1, -1, 1, 1, 0.5, 1])}
    below, above = (inverted_interval(d, PValue(p)) for p in (0.049, 0.051))
    assert below.significant and not above.significant
    assert below.low > 0 and above.low <= 0


def test_clusters_flip_together():
    """Samples sharing a cluster are negated together: the test is the one over cluster sums, and
    with every sample its own cluster it is the unclustered test."""
    d = {"x": np.array([1.0, 1, 1, 0, 0, 0, 1, 1]), "y": np.array([1.0, 0, 1, 1, 0, 0, 1, 0])}
    singletons = {"x": [f"x{i}" for i in range(8)], "y": [f"y{i}" for i in range(8)]}
    assert sign_flip_p(d, clusters=singletons) == sign_flip_p(d)
    pairs = {"x": ["c0", "c0", "c1", "c1", "c2", "c2", "c3", "c3"], "y": ["c4", "c4", "c5", "c5", "c6", "c6", "c7", "c7"]}
    sums = np.array([2, 1, 0, 2, 1, 1, 0, 1]) / 16  # cluster sums of the weighted differences
    patterns = np.arange(256)[:, None] >> np.arange(8) & 1
    brute = np.mean(np.abs((2 * patterns - 1) @ sums) >= sums.sum() * (1 - 1e-9))
    assert sign_flip_p(d, clusters=pairs) == pytest.approx(brute)
    assert sign_flip_p(d, clusters=pairs) > sign_flip_p(d)  # fewer independent units: less evidence


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

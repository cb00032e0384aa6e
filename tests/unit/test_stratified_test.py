"""The stratified, studentized sign-flip test and the interval that inverts it (issue 65, item 3),
checked against computations written out here and by coverage simulation beside the stratified
t-interval (no engine)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.analysis.stats import (EXACT_UP_TO, FLIPS, PValue, _Stratified, _round_bound, can_decide,
                                    fewest_units_to_decide, inverted_interval, settled_p_values, sign_flip_p,
                                    sign_flip_test, smallest_p, stratified_t_interval)


def written_out(per_task: dict[str, np.ndarray], shift: float = 0.0) -> tuple[float, np.ndarray]:
    """|Z(shift)| and |Z*| of every sign pattern, from the definition: each sample's difference
    weighted 1 / (tasks x samples of its task), centred on its task's mean, the stratified
    variance sum_t n_t/(n_t - 1) sum (centred)^2, the pattern's statistic the flipped centred
    sum over the square root of the same variance of the flipped units."""
    tasks = sorted(per_task)
    c = np.concatenate([np.asarray(per_task[t], float) / (len(per_task[t]) * len(tasks)) for t in tasks])
    stratum = np.concatenate([np.full(len(per_task[t]), i) for i, t in enumerate(tasks)])
    r = c.copy()
    for i in range(len(tasks)):
        r[stratum == i] -= c[stratum == i].mean()

    def variance(units: np.ndarray) -> float:
        total = 0.0
        for i in range(len(tasks)):
            u = units[stratum == i]
            total += len(u) / (len(u) - 1) * np.sum((u - u.mean()) ** 2)
        return total

    observed = abs(c.sum() - shift) / math.sqrt(variance(c))
    patterns = ((np.arange(2 ** len(c))[:, None] >> np.arange(len(c))) & 1) * 2.0 - 1.0
    z = np.array([abs(np.sum(e * r)) / math.sqrt(variance(e * r)) if abs(np.sum(e * r)) > 1e-15 else 0.0
                  for e in patterns])
    return observed, z


def written_out_p(per_task: dict[str, np.ndarray], shift: float = 0.0) -> float:
    observed, z = written_out(per_task, shift)
    return (1 + np.count_nonzero(z >= observed * (1 - 1e-9))) / (1 + len(z))


def test_the_p_value_is_the_written_out_count_of_every_pattern():
    rng = np.random.default_rng(65)
    cases = [{"t": rng.normal(0.4, 1, 9)},
             {"a": rng.normal(0.5, 1, 5), "b": rng.normal(-0.2, 2, 6)},
             {"a": rng.choice([-1.0, 0.0, 1.0], 6), "b": np.array([1.0, 0, 0, 1, 0, 1, 1])},
             {"a": np.array([-1.0, 0, 0, 0, 0, 0]), "b": np.array([-1.0, -1, 0, 0, 0, 0])}]
    for case in cases:
        result = sign_flip_test(case)
        assert result.flips == 0 and result.p == pytest.approx(written_out_p(case), rel=1e-12), case


def test_zero_differences_take_part_the_same_way_at_every_shift():
    """Four of twenty samples 1 point worse, the rest equal: before, the zeros dropped out at s = 0
    and took part at every other shift, so the interval ended exactly at 0 beside p = 0.125. Now
    the reference distribution is the same at every shift, and the interval's upper end lies past
    zero as its p (above 0.05) says, by a visible margin."""
    d = {"t": np.r_[-np.ones(4), np.zeros(16)]}
    p = sign_flip_test(d)
    interval = inverted_interval(d, p)
    assert p.p >= 0.05 and interval.low < -30 and interval.high > 0.05
    _, z_at_zero = written_out({"t": np.r_[-np.ones(3), np.zeros(8)]})
    _, z_shifted = written_out({"t": np.r_[-np.ones(3), np.zeros(8)]}, shift=0.07)
    assert np.array_equal(z_at_zero, z_shifted)  # the reference does not move with the shift


def test_exact_bounds_are_where_the_shifted_test_starts_rejecting():
    d = {"a": np.array([1, 1, 0, 1, 0.5, 1.0]), "b": np.array([0, 1, 1, 0.5, 1, 1.0])}
    interval = inverted_interval(d, sign_flip_test(d), digits=6)
    assert interval.resamples == 0 and interval.low > 0
    for bound, outward in ((interval.low, -1), (interval.high, 1)):
        assert written_out_p(d, (bound - outward * 1e-4) / 100) >= 0.05
        assert written_out_p(d, (bound + outward * 1e-4) / 100) < 0.05


def test_the_interval_excludes_zero_exactly_when_its_test_rejects():
    rng = np.random.default_rng(51)
    seen = {True: 0, False: 0}
    for case in range(50):
        tasks, n = (1, int(rng.integers(6, 20))) if case % 3 else (3, int(rng.integers(10, 25)))
        shift = rng.choice([0.0, 0.2, 0.4])
        d = {f"t{i}": rng.choice([-1.0, 0.0, 0.0, 1.0, 0.5], size=n) + shift for i in range(tasks)}
        p = sign_flip_test(d)
        interval = inverted_interval(d, p)
        assert interval.significant == (p.p < 0.05), (d, p, interval)
        seen[p.p < 0.05] += 1
    assert min(seen.values()) >= 10, seen


def test_strata_do_not_widen_the_interval():
    """Two tasks far apart (means -1 and +1.5): the unstratified sign-flip reference spread the
    task means around the average into its null and was wider than the stratified standard error
    (issue 65: 12% typically, up to 2x). Centred within tasks, the interval is the stratified t's
    width within a few percent."""
    rng = np.random.default_rng(3)
    d = {"a": rng.normal(-1.0, 0.5, 30), "b": rng.normal(1.5, 0.7, 30)}
    interval = inverted_interval(d, sign_flip_test(d), scale=1, digits=6)
    reference = stratified_t_interval(d, scale=1)
    assert (interval.high - interval.low) == pytest.approx(reference.high - reference.low, rel=0.06)
    weights = np.concatenate([d["a"], d["b"]]) / 60  # the old reference: sum_i w_i^2 d_i^2, uncentred
    unstratified = 2 * 1.96 * math.sqrt(np.sum(weights ** 2))
    assert unstratified > 1.5 * (interval.high - interval.low)


SCENARIOS = {
    # (per-task differences, the true mean over tasks of the task means)
    "dense": (lambda rng: {"a": rng.normal(0.3, 1, 8), "b": rng.normal(0.3, 1, 8)}, 0.3),
    "heterogeneous": (lambda rng: {"a": rng.normal(-1.0, 0.5, 8), "b": rng.normal(1.5, 1.5, 8)}, 0.25),
    "sparse one-sided": (lambda rng: {t: -(rng.random(8) < 0.15).astype(float) for t in "ab"}, -0.15),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_coverage_by_simulation_beside_the_stratified_t(scenario):
    """200 simulated comparisons of 2 tasks x 8 samples (every pattern enumerated): the 95%
    interval covers the true mean about as often as the stratified t-interval and near 95%.
    Sparse one-sided (each sample 1 point worse with probability 0.15, else equal): 7% of tables
    have no differing sample at all (0.85^16), where any interval from the data is the point 0;
    among the others the interval covers (the old unstratified test's fell to about 0.74 here)."""
    make, truth = SCENARIOS[scenario]
    rng = np.random.default_rng(65)
    covered = covered_t = degenerate = 0
    reps = 200
    for _ in range(reps):
        d = make(rng)
        interval = inverted_interval(d, sign_flip_test(d), scale=1, digits=6)
        reference = stratified_t_interval(d, scale=1)
        covered += interval.low <= truth <= interval.high
        covered_t += reference.low <= truth <= reference.high
        degenerate += not any(np.any(v != 0) for v in d.values())
    assert covered / reps >= covered_t / reps - 0.02, (covered, covered_t)
    if scenario == "sparse one-sided":
        assert covered / (reps - degenerate) >= 0.95, (covered, degenerate)
    else:
        assert covered / reps >= 0.91, covered


def test_clusters_flip_together():
    d = {"x": np.array([1.0, 1, 1, 0, 0, 0, 1, 1]), "y": np.array([1.0, 0, 1, 1, 0, 0, 1, 0])}
    singletons = {"x": [f"x{i}" for i in range(8)], "y": [f"y{i}" for i in range(8)]}
    assert sign_flip_p(d, clusters=singletons) == sign_flip_p(d)
    pairs = {"x": ["c0", "c0", "c1", "c1", "c2", "c2", "c3", "c3"], "y": ["c4", "c4", "c5", "c5", "c6", "c6", "c7", "c7"]}
    # Cluster sums as units, two strata of four: the written-out test of the cluster sums, each
    # task's clusters of equal weight (so centring on the stratum mean is centring on weight).
    sums = {"x": np.array([2, 1, 0, 2.0]) / 2, "y": np.array([1, 2, 0, 1.0]) / 2}
    assert sign_flip_p(d, clusters=pairs) == pytest.approx(written_out_p(sums), rel=1e-12)
    assert smallest_p(8) == 1 / 257


def test_random_patterns_are_seeded_by_the_data_and_split_invariant():
    rng = np.random.default_rng(12)
    d = {"t": rng.normal(0.25, 1, EXACT_UP_TO + 4)}
    first = sign_flip_test(d)
    assert first.flips == FLIPS and first == sign_flip_test(d)
    split = _Stratified(d)
    split.draw(3_000)
    split.draw(FLIPS)
    assert split.result() == first
    assert sign_flip_test({"t": -d["t"]}) == first  # B minus A: the same test


def close_family() -> list[dict[str, np.ndarray]]:
    """Eighteen units whose exact p is 0.0044 (all 2^18 patterns, counted below), so that Holm's
    first step over ten comparisons (0.05 / 10 = 0.005) cannot be told by 10,000 random patterns;
    then one comparison far from any level and eight with no difference."""
    rng = np.random.default_rng(21)
    base = rng.normal(0, 1, 18)
    close = {"t": base - base.mean() + 1.0122}
    noise = rng.normal(0, 1, 50)
    return [close, {"t": noise - noise.mean() + 0.02}] + [{"t": np.zeros(20)}] * 8


def test_a_p_value_whose_holm_decision_straddles_the_level_is_refined_until_settled(monkeypatch):
    from harness.analysis import stats

    monkeypatch.setattr(stats, "EXACT_UP_TO", 16)  # 18 units: random patterns, as past the real limit
    family = close_family()
    test = _Stratified(family[0])
    patterns = ((np.arange(2 ** 18)[:, None] >> np.arange(18)) & 1) * 2.0 - 1.0
    z = test._statistics(patterns)
    exact = (1 + np.count_nonzero(z >= test.threshold)) / (1 + 2 ** 18)
    assert 0.004 < exact < 0.0048
    first = sign_flip_test(family[0])
    assert first.bounds()[0] < 0.005 < first.bounds()[1], "the constructed case: 10,000 flips cannot tell"
    values = settled_p_values(family, alpha=0.05)
    assert values[0].settled and FLIPS < values[0].flips <= 10_000_000 and values[0].bounds()[1] < 0.005
    assert abs(values[0].p - exact) < 4 * values[0].se
    assert values[1].flips == FLIPS, "a p-value no mark depends on is not refined"
    assert all(v.flips == 0 and v.p == 1.0 for v in values[2:])
    capped = settled_p_values(family, alpha=0.05, max_flips=FLIPS)
    assert not capped[0].settled


def test_a_bound_never_prints_on_the_wrong_side_of_zero():
    assert _round_bound(0.003, 2) == 0.01 and _round_bound(-0.003, 2) == -0.01
    assert _round_bound(0.0, 2) == 0.0 and _round_bound(1.234, 2) == 1.23
    # Beside p < 0.05 an interval's bound is never printed as 0.00.
    d = {"t": np.r_[np.ones(9), np.zeros(3), -np.ones(1)]}
    p = sign_flip_test(d)
    interval = inverted_interval(d, p)
    assert p.p < 0.05 and interval.low > 0


def test_a_design_that_cannot_decide_is_recognised():
    """Eight clusters: every one of the 256 patterns enumerated, the smallest p 1/257; Holm over
    ten such comparisons needs 10/257 = 0.039 < 0.05 (can decide), over sixteen 0.062 (cannot)."""
    assert can_decide([8] * 10) and not can_decide([8] * 16)
    assert not can_decide([4])  # 1/17 > 0.05: four units never reject
    assert can_decide([80] * 100)
    assert not can_decide([])


def test_the_fewest_clusters_that_let_a_family_decide_are_the_first_count_can_decide_accepts():
    """Sixteen comparisons need 16 / (1 + 2^k) < 0.05: k = 9 (16/513 = 0.031; eight give 0.062);
    one comparison needs five (1/33 = 0.030; four give 1/17 = 0.059)."""
    assert fewest_units_to_decide(16) == 9 and can_decide([9] * 16) and not can_decide([8] * 16)
    assert fewest_units_to_decide(10) == 8 and fewest_units_to_decide(1) == 5


def test_the_reported_p_value_decides_zero_where_more_draws_would_not():
    d = {"t": np.array([1.0, 1, 1, 1, 1, 0, 1, -1, 1, 1, 0.5, 1])}
    below, above = (inverted_interval(d, PValue(p)) for p in (0.049, 0.051))
    assert below.significant and not above.significant

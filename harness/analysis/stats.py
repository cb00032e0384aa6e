"""How sure a number is: bootstrap intervals, paired sign-flip tests and their adjustment.

Everything works on per-sample values grouped by task (``{task: array}``) and on one statistic:
the unweighted mean over tasks of the task means (a task's own mean when there is one task),
times ``scale`` (100 puts scores in [0, 1] on LongBench's 0-100 scale; 1 leaves a quantity such as
a log-likelihood in its own units). A paired difference is the same statistic of the per-sample
differences of two runs on the same samples, so the noise both runs share (an easy or a hard
sample) cancels.

* Intervals: ``bca_interval`` (bias-corrected and accelerated, Efron 1987) on the bootstrap
  distribution that resamples each task's samples with replacement (tasks within themselves, as
  the average weighs them equally). The plain percentile interval is too narrow for skewed 0/1
  scores at 20 samples per task; BCa corrects its coverage to second order. Where the samples take
  few values (0/1 scores) that distribution is computed exactly. Otherwise it is drawn, and a
  bound from random resamples has a Monte Carlo error of its own: ``bca_interval`` measures it
  (sectioning: the same bounds from ten disjoint tenths of the draws) and resamples more, from
  ``RESAMPLES`` up to ``MAX_RESAMPLES``, until it is below a target (``mc_target``: 0.1 point on
  the 0-100 scale, 0.01 in a quantity's own units).
* Tests: ``sign_flip_test`` is the two-sided paired permutation test (each sample's difference is
  as likely negated under the null): exact by enumerating every sign pattern when at most
  ``EXACT_UP_TO`` differences are non-zero, else from random sign patterns, with the p-value's
  Monte Carlo standard error.
* A table's comparisons form one family: ``holm`` (family-wise error) and ``benjamini_hochberg``
  (false discovery rate) adjust its p-values. ``settled_p_values`` gives a family's p-values with
  the random ones refined (ten times the flips, up to ``MAX_FLIPS``) until no mark could change
  within their Monte Carlo error. ``detectable_difference`` is the smallest true difference a
  comparison finds with 80% power at a given level.
* Seeds: every interval and every test draws from its own generator, seeded by a hash of its own
  data (``data_seed``). A rerun gives the same numbers; two comparisons never share draws, so their
  Monte Carlo errors are independent instead of all moving together as one shared seed made them.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

LEVEL = 0.95
SCALE = 100  # scores in [0, 1] are reported on LongBench's 0-100 scale
RESAMPLES = 10_000  # bootstrap resamples an interval starts from
MAX_RESAMPLES = 1_280_000  # ... and may grow to (10,000 doubled seven times)
SECTIONS = 10  # disjoint parts of the draws whose bounds measure the bounds' Monte Carlo error
EXACT_OUTCOMES = 100_000  # distinct resamples up to which the bootstrap distribution is computed, not drawn
MC_TARGET_POINTS = 0.1  # largest Monte Carlo error of a bound on the 0-100 scale (points)
MC_TARGET_UNITS = 0.01  # ... of a quantity kept in its own units (nats)
_ELEMENTS = 1 << 18  # resampled sample indices held at once (2 MB: fast in cache, and bounds memory)

_NORMAL = NormalDist()


def mc_target(scale: float) -> float:
    """The Monte Carlo error a bound must get below: 0.1 point for a quantity reported on the
    0-100 scale (``scale`` 100), 0.01 for one kept in its own units (a log-likelihood in nats):
    the targets issue 37 set, well below the differences the tables discuss."""
    return MC_TARGET_POINTS if scale == SCALE else MC_TARGET_UNITS


def data_seed(kind: str, arrays: list[np.ndarray], labels: tuple[str, ...] = ()) -> int:
    """A generator seed made from the data itself: a stable hash (BLAKE2b, not Python's salted
    ``hash``) of ``kind``, the labels and lengths, and the values' bytes. Different data get
    independent draws, the same data the same draws on every run and machine. The data and its
    negation hash alike (the smaller of the two byte strings is hashed), so A minus B and B minus A
    draw the same patterns and give mirrored results; -0.0 is made 0.0 first."""
    values = np.concatenate([np.asarray(a, dtype=float).ravel() for a in arrays]) if arrays else np.zeros(0)
    digest = hashlib.blake2b(kind.encode(), digest_size=8)
    for index, array in enumerate(arrays):
        label = labels[index] if index < len(labels) else ""
        digest.update(f"{label}:{len(array)};".encode())
    digest.update(min((values + 0.0).tobytes(), (0.0 - values + 0.0).tobytes()))
    return int.from_bytes(digest.digest(), "little")


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    samples: int
    mc_error: float = 0.0  # Monte Carlo standard error of the bounds (the larger of the two); 0 when exact
    resamples: int = 0  # bootstrap resamples the bounds come from; 0: the exact bootstrap distribution

    @property
    def significant(self) -> bool:
        """For a difference: the interval excludes zero."""
        return self.low > 0 or self.high < 0

    def negated(self) -> "Interval":
        """The same interval for the difference taken the other way round (B minus A). Exact:
        negating every sample negates every resampled statistic, the median bias and the skew, so
        the bounds swap and change sign; their Monte Carlo errors swap with them."""
        return Interval(0.0 - self.estimate, 0.0 - self.high, 0.0 - self.low, self.samples, self.mc_error,
                        self.resamples)


def _arrays(per_task: dict[str, np.ndarray], scale: float) -> tuple[list[str], list[np.ndarray]]:
    tasks = sorted(per_task)
    return tasks, [scale * np.asarray(per_task[t], dtype=float) for t in tasks]


def bootstrap(per_task: dict[str, np.ndarray], resamples: int = 2000, seed: int = 0,
              scale: float = SCALE) -> dict[str, np.ndarray]:
    """Per task, ``resamples`` resampled means x ``scale`` from one generator seeded ``seed``. The
    fixed-seed draws that experiments/proxy_quality.py and experiments/train_scorer.py quote; the
    summaries' intervals do not use it (``bca_interval`` draws its own, seeded by its data)."""
    rng = np.random.default_rng(seed)
    means = {}
    for task, values in zip(*_arrays(per_task, scale)):
        draws = rng.integers(0, len(values), size=(resamples, len(values)))
        means[task] = values[draws].mean(axis=1)
    return means


def _rounded(value: float, digits: int = 2) -> float:
    return round(float(value), digits) + 0.0  # + 0.0: a bound that rounds to -0.0 prints as 0.00, not "-0.00"


def _resampled_statistics(values: list[np.ndarray], count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` bootstrap statistics: each task's samples drawn with replacement (per task in
    sorted order, a (count x samples) block of indices, in row blocks that bound memory: the
    generator yields the same indices either way), then the mean over tasks of the task means."""
    total = np.zeros(count)
    for v in values:
        rows = max(1, _ELEMENTS // len(v))
        for start in range(0, count, rows):
            stop = min(count, start + rows)
            total[start:stop] += v[rng.integers(0, len(v), size=(stop - start, len(v)))].mean(axis=1)
    return total / len(values)


def _acceleration(values: list[np.ndarray]) -> float:
    """BCa's acceleration a: the skew of the jackknife (leave one sample out of its task,
    recompute the statistic; Efron 1987)."""
    means = [v.mean() for v in values]
    leave_one_out = []
    for index, v in enumerate(values):
        if len(v) < 2:
            continue
        others = sum(means) - means[index]
        leave_one_out.extend((others + (v.sum() - v) / (len(v) - 1)) / len(values))
    leave_one_out = np.asarray(leave_one_out)
    spread = leave_one_out.mean() - leave_one_out if len(leave_one_out) else leave_one_out
    denominator = 6 * np.sum(spread ** 2) ** 1.5
    return float(np.sum(spread ** 3) / denominator) if denominator > 0 else 0.0


def _share_below(values: np.ndarray, estimate: float, probabilities: np.ndarray | None = None) -> float:
    """The share of the bootstrap distribution below the estimate, ties counted half (z0's input).
    ``values``: resampled statistics (each counted once) or, with ``probabilities``, the exact
    distribution's possible values."""
    # Values equal to the estimate up to summation order are ties (F1 scores, 1/3, 0.1 are not
    # exact binary fractions; exact equality would misclassify them and shift z0).
    tie = np.abs(values - estimate) <= 1e-9 * max(1.0, abs(estimate))
    weights = np.ones(len(values)) if probabilities is None else probabilities
    return float((np.sum(weights[(values < estimate) & ~tie]) + 0.5 * np.sum(weights[tie])) / np.sum(weights))


def _bca_levels(below: float, acceleration: float) -> list[float]:
    """The percentiles (0-100) of the bootstrap distribution that BCa reads its bounds at: the
    percentile interval's 2.5 and 97.5 shifted by the median bias z0 = Phi^-1(``below``) and
    stretched by the acceleration a (Efron 1987)."""
    z0 = _NORMAL.inv_cdf(below)
    tail = (1 - LEVEL) / 2
    levels = []
    for z in (_NORMAL.inv_cdf(tail), _NORMAL.inv_cdf(1 - tail)):
        stretch = 1 - acceleration * (z0 + z)
        if stretch <= 0:  # extreme skew (a >= 1/(z0 + z)): the bound runs to the end of the distribution
            levels.append(100.0 if z > 0 else 0.0)
            continue
        levels.append(100 * _NORMAL.cdf(z0 + (z0 + z) / stretch))
    return levels


def _bca_bounds(draws: np.ndarray, estimate: float, acceleration: float) -> np.ndarray:
    """The BCa bounds (low, high) from resampled statistics: their percentiles at ``_bca_levels``."""
    below = min(max(_share_below(draws, estimate), 1 / (len(draws) + 1)), len(draws) / (len(draws) + 1))
    return np.percentile(draws, _bca_levels(below, acceleration))


def _bounds_error(draws: np.ndarray, estimate: float, acceleration: float) -> float:
    """Monte Carlo standard error of the bounds, by sectioning: the same BCa bounds (each part with
    its own z0, so z0's noise counts) from ``SECTIONS`` disjoint parts of the draws; their standard
    deviation over sqrt(SECTIONS) is the error of bounds from all the draws (a quantile's variance
    falls as 1/draws). The larger of the two bounds' errors."""
    parts = np.array([_bca_bounds(part, estimate, acceleration) for part in np.array_split(draws, SECTIONS)])
    return float(np.max(parts.std(axis=0, ddof=1)) / np.sqrt(SECTIONS))


def _convolve(values: np.ndarray, probabilities: np.ndarray, steps: np.ndarray,
              step_probabilities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distribution of X + Y for independent X and Y given as (values, probabilities); sums
    equal to 9 decimals are one value (the same sum reached in another order differs in the last
    bits)."""
    sums = np.round((values[:, None] + steps[None, :]).ravel(), 9)
    merged, index = np.unique(sums, return_inverse=True)
    return merged, np.bincount(index, weights=(probabilities[:, None] * step_probabilities[None, :]).ravel())


def _bootstrap_distribution(values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """The bootstrap distribution of the statistic itself, computed rather than drawn, when the
    samples take so few distinct values that there are at most ``EXACT_OUTCOMES`` distinct
    resamples: a task of n samples with d distinct values has C(n + d - 1, d - 1) of them (how
    often each value is drawn), 21 for 0/1 scores at 20 samples, 231 for three values; tasks
    multiply. A resampled task mean is the sum of n independent draws of a value / n, the
    statistic the sum of the task means / tasks: convolutions. None when there are more.

    This is where resampling fails: the statistic then lives on a coarse lattice (steps of 5
    points for 20 0/1 scores), a BCa bound can fall on one of its steps, and which side of it the
    bound lands on is decided by a difference in level no feasible number of resamples resolves."""
    distinct = [np.unique(v, return_counts=True) for v in values]
    outcomes = math.prod(math.comb(len(v) + len(u) - 1, len(u) - 1) for v, (u, _) in zip(values, distinct))
    if outcomes > EXACT_OUTCOMES:
        return None
    support, probabilities = np.zeros(1), np.ones(1)
    for v, (u, counts) in zip(values, distinct):
        step, step_probabilities = u / (len(v) * len(values)), counts / len(v)  # one draw's share of the statistic
        for _ in range(len(v)):
            support, probabilities = _convolve(support, probabilities, step, step_probabilities)
    return support, probabilities


def _exact_bounds(support: np.ndarray, probabilities: np.ndarray, estimate: float, acceleration: float
                  ) -> np.ndarray:
    """The BCa bounds from the exact bootstrap distribution: its quantiles (the smallest value whose
    cumulative probability reaches the level, what percentiles of ever more draws converge to) at
    ``_bca_levels``."""
    below = min(max(_share_below(support, estimate, probabilities), 1e-12), 1 - 1e-12)
    cumulative = np.cumsum(probabilities)
    positions = np.searchsorted(cumulative, np.asarray(_bca_levels(below, acceleration)) / 100, side="left")
    return support[np.minimum(positions, len(support) - 1)]


def bca_interval(per_task: dict[str, np.ndarray], *, scale: float = SCALE, digits: int = 2,
                 target: float | None = None, resamples: int = RESAMPLES,
                 max_resamples: int = MAX_RESAMPLES) -> Interval:
    """A bias-corrected and accelerated (BCa) 95% interval for the mean over tasks of the task
    means (x ``scale``, rounded to ``digits`` decimals), with the Monte Carlo error of its bounds.

    The percentiles of the stratified bootstrap distribution, shifted by its median bias (z0) and
    stretched by the skew the jackknife measures (acceleration a; Efron 1987). With 20 samples
    the percentile interval is too narrow for skewed 0/1 scores; BCa corrects that to second order.

    The bootstrap distribution is computed exactly where the samples take few values
    (``_bootstrap_distribution``: no Monte Carlo error, ``resamples`` 0). Otherwise it is drawn,
    from a generator seeded by the data (``data_seed``): ``resamples`` at first; while the bounds'
    Monte Carlo error (``_bounds_error``) is at or above ``target`` (default ``mc_target(scale)``),
    more: the count the error predicts (it falls as 1/sqrt(resamples)), at least double, up to
    ``max_resamples``, the new draws added to the old. ``max_resamples`` = ``resamples`` gives a
    fixed count.

    Used for one cell's value of independent samples, which no test accompanies
    (``cell_interval``); a paired difference gets ``inverted_interval``, which cannot disagree with
    its p-value."""
    samples = sum(len(np.asarray(v)) for v in per_task.values())
    tasks, values = _arrays(per_task, scale)
    estimate = float(np.mean([v.mean() for v in values]))
    acceleration = _acceleration(values)
    exact = _bootstrap_distribution(values)
    if exact is not None:
        low, high = _exact_bounds(*exact, estimate, acceleration)
        return Interval(_rounded(estimate, digits), _rounded(low, digits), _rounded(high, digits), samples)
    target = mc_target(scale) if target is None else target
    rng = np.random.default_rng(data_seed("bootstrap", [per_task[t] for t in tasks], tuple(tasks)))
    draws = _resampled_statistics(values, resamples, rng)
    while True:
        error = _bounds_error(draws, estimate, acceleration)
        if error < target or len(draws) >= max_resamples:
            break
        wanted = len(draws) * (error / target) ** 2 * 1.1  # 10% over the prediction: it is itself noisy
        grown = 2 * len(draws)
        while grown < min(wanted, max_resamples):
            grown *= 2
        grown = min(grown, max_resamples)
        draws = np.concatenate([draws, _resampled_statistics(values, grown - len(draws), rng)])
    low, high = _bca_bounds(draws, estimate, acceleration)
    return Interval(_rounded(estimate, digits), _rounded(low, digits), _rounded(high, digits), samples,
                    round(error, digits + 2), len(draws))


# Two-sided 95% quantiles of Student's t with 1..10 degrees of freedom (any table of t).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_975(df: int) -> float:
    """Student's t 97.5% quantile: the table up to 10 degrees of freedom, above it the
    Cornish-Fisher expansion in 1/df (within 0.001 of the exact quantile from 11 on)."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = _NORMAL.inv_cdf(0.975)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) + (
        3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)


def ratio_interval(ratios: list[float]) -> Interval:
    """A ratio measured once per trial (trials = independent engine processes run back to back):
    the geometric mean and a 95% t-interval on the log ratios. With 3 trials the t quantile is
    4.3: the interval is honest about how little three processes say, not optimistic."""
    logs = np.log(np.asarray(ratios, dtype=float))
    n = len(logs)
    if n < 2:
        raise ValueError("an interval over trials needs at least two trials")
    if n - 1 > len(T_975):
        raise ValueError(f"at most {len(T_975) + 1} trials")
    half = T_975[n - 2] * logs.std(ddof=1) / np.sqrt(n)
    mean = logs.mean()
    return Interval(float(np.exp(mean)), float(np.exp(mean - half)), float(np.exp(mean + half)), n)


def trend_ratios(values: list[float], configurations: list[str], positions: list[float], baseline: str
                 ) -> dict | None:
    """Throughput measured in trials that drift: log(value) fitted by least squares as one level per
    configuration plus a straight line in run position (the machine slowing or speeding up), so a
    configuration that ran later is not charged with the drift. Returns each configuration's ratio
    to ``baseline`` (exp of the level difference) and the drift per position step (a factor), each
    with a 95% t-interval from the residual variance; None when the fit has no residual degree of
    freedom. ``df``: residual degrees of freedom."""
    names = sorted(set(configurations), key=lambda name: (name != baseline, configurations.index(name)))
    y = np.log(np.asarray(values, dtype=float))
    design = np.column_stack([[1.0 if c == name else 0.0 for c in configurations] for name in names]
                             + [np.asarray(positions, dtype=float) - np.mean(positions)])
    df = len(y) - design.shape[1]
    if df < 1 or np.linalg.matrix_rank(design) < design.shape[1]:
        return None
    coefficients, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ coefficients
    covariance = (residual @ residual / df) * np.linalg.inv(design.T @ design)
    t = t_975(df)

    def interval(vector: np.ndarray) -> Interval:
        estimate, se = float(vector @ coefficients), float(np.sqrt(vector @ covariance @ vector))
        return Interval(math.exp(estimate), math.exp(estimate - t * se), math.exp(estimate + t * se), len(y))

    ratios = {}
    for index, name in enumerate(names[1:], 1):
        contrast = np.zeros(design.shape[1])
        contrast[index], contrast[0] = 1.0, -1.0
        ratios[name] = interval(contrast)
    slope = np.zeros(design.shape[1])
    slope[-1] = 1.0
    return {"ratios": ratios, "drift": interval(slope), "df": df}


# ---------------------------------------------------------------- tests over a table's comparisons
EXACT_UP_TO = 40  # non-zero differences up to which every sign pattern is enumerated (0.1 s at 40)
FLIPS = 10_000  # random sign patterns a Monte Carlo p-value starts from
MAX_FLIPS = 10_000_000  # ... and may be refined to (settled_p_values)
WIDTH = 4  # Monte Carlo standard errors either side of a p-value within which its marks must hold
_FLIP_ROWS = 1 << 16  # random sign patterns evaluated at once (bounds memory)


@dataclass(frozen=True)
class PValue:
    """A sign-flip p-value with what it took: ``flips`` random sign patterns (0: exact, every
    pattern enumerated), its Monte Carlo standard error ``se`` (0 when exact), and, from
    ``settled_p_values``, whether its family's Holm and Benjamini-Hochberg decisions about it
    hold anywhere within ``WIDTH`` standard errors of every random p-value of the family."""
    p: float
    flips: int = 0
    se: float = 0.0
    settled: bool = True

    @property
    def exact(self) -> bool:
        return self.flips == 0

    def bounds(self) -> tuple[float, float]:
        """p +- ``WIDTH`` standard errors, within [0, 1] (the exact p may lie below the smallest
        Monte Carlo p, 1/(flips + 1)); the p itself when exact."""
        return max(0.0, self.p - WIDTH * self.se), min(1.0, self.p + WIDTH * self.se)


def _units(per_task: dict[str, np.ndarray], clusters: dict[str, np.ndarray] | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """The units a sign-flip test flips, as (values, weights): each sample's difference d_i times its
    weight w_i = 1 / (tasks x samples of its task), and w_i itself, so that the statistic is the sum
    of the values and shifting every difference by s shifts it by s x the sum of the weights (1).

    ``clusters`` (per task, one label per sample, aligned with ``per_task``): samples that share a
    label share a context, a conversation or a document, so their differences are not independent
    and the null can only negate them together; a unit is then a cluster, its value and weight the
    sums over its samples. A label names one cluster across tasks (a context asked questions of two
    tasks is one cluster). Without ``clusters`` every sample is its own unit."""
    tasks = sorted(per_task)
    values, weights, labels = [], [], []
    for task in tasks:
        d = np.asarray(per_task[task], dtype=float)
        weights.append(np.full(len(d), 1.0 / (len(d) * len(tasks))))
        values.append(d / (len(d) * len(tasks)))  # divided, not times the weight: the same bits (and seed) as before
        if clusters is not None:
            label = np.asarray(clusters[task], dtype=object)
            if len(label) != len(d):
                raise ValueError(f"{task}: {len(label)} cluster labels for {len(d)} samples")
            labels.extend(str(x) for x in label)
    if not values:
        return np.zeros(0), np.zeros(0)
    values, weights = np.concatenate(values), np.concatenate(weights)
    if clusters is None:
        return values, weights
    names, index = np.unique(np.asarray(labels), return_inverse=True)
    return (np.bincount(index, weights=values, minlength=len(names)),
            np.bincount(index, weights=weights, minlength=len(names)))


def _weighted(per_task: dict[str, np.ndarray], clusters: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The non-zero units' values (``_units``): the statistic is the sum of these with their signs,
    and only a non-zero unit can change sign. Unclustered, each sample's difference weighted by
    1 / (tasks x samples of its task)."""
    values = _units(per_task, clusters)[0]
    return values[values != 0]


def _sorted_signed_sums(weights: np.ndarray) -> np.ndarray:
    """The 2^len(weights) sums of +-w_i, one per sign pattern, sorted: each weight turns the sorted
    sums s into the merge of s + w and s - w, two sorted runs that a stable sort (timsort) merges
    in linear time, so the whole costs about 2 x 2^len(weights) steps, not a sort of 2^len(weights)
    values (twice as fast at 2^20 sums, and the bisection of an exact interval asks thousands of
    times). Each sum is added up in the weights' order whatever the pattern."""
    sums = np.zeros(1)
    for w in weights:
        sums = np.sort(np.concatenate([sums + w, sums - w]), kind="stable")
    return sums


def _enumerated_p(weighted: np.ndarray, threshold: float) -> float:
    """Exact: the share of all 2^k sign patterns whose |sum| reaches ``threshold``, by meet in the
    middle. A pattern is a pattern of the first half of the differences and one of the second,
    its sum a + b; with the second half's 2^(k/2) sums b sorted, the b with a + b >= threshold or
    a + b <= -threshold form two ranges, found for every a by binary search. 2 x 2^(k/2) sums
    and searches instead of 2^k patterns: k = 40 takes about 0.1 s."""
    half = len(weighted) // 2
    first = _sorted_signed_sums(weighted[:half])  # sorted queries search faster
    second = _sorted_signed_sums(weighted[half:])
    high = len(second) - np.searchsorted(second, threshold - first, side="left")  # a + b >= threshold
    low = np.searchsorted(second, -threshold - first, side="right")  # a + b <= -threshold
    return float((int(high.sum()) + int(low.sum())) / 2.0 ** len(weighted))


class _SignFlips:
    """One comparison's sign-flip test: exact when its non-zero differences are few, else random
    sign patterns that ``draw`` extends. The patterns come as raw 64-bit words from a generator
    seeded by the differences (``data_seed``), one or more whole words per pattern, so the first N
    patterns are the same however the drawing was split: a p-value from N flips depends on the
    data and N alone. Each byte of a word gives the signs of 8 differences, and a 256-entry table
    per group of 8 differences holds each byte's signed sum: the statistic of a pattern is k/8
    table look-ups."""

    def __init__(self, per_task: dict[str, np.ndarray], clusters: dict[str, np.ndarray] | None = None):
        weighted = _weighted(per_task, clusters)
        observed = abs(weighted.sum())
        self.threshold = observed * (1 - 1e-9)  # the observed pattern itself counts despite float rounding
        self.flips = self.extreme = 0
        self.exact_p = None
        k = len(weighted)
        if observed == 0:
            self.exact_p = 1.0  # no difference (or exactly cancelling ones): nothing to test
        elif k <= EXACT_UP_TO:
            self.exact_p = _enumerated_p(weighted, self.threshold)
        else:
            groups = -(-k // 8)
            padded = np.zeros(8 * groups)  # padding with zeros: their signs change nothing
            padded[:k] = weighted
            signs = 2 * ((np.arange(256)[:, None] >> np.arange(8)) & 1) - 1  # byte value -> its 8 signs
            self.tables = padded.reshape(groups, 8) @ signs.T  # (groups, 256)
            self.words = -(-k // 64)
            self.bits = np.random.PCG64(data_seed("sign flips", [weighted]))

    def draw(self, flips: int) -> None:
        """Draw random sign patterns until ``flips`` have been drawn in all."""
        while self.flips < flips:
            rows = min(_FLIP_ROWS, flips - self.flips)
            patterns = self.bits.random_raw(rows * self.words).reshape(rows, self.words).view(np.uint8)
            statistic = self.tables[0][patterns[:, 0]]
            for group in range(1, len(self.tables)):
                statistic += self.tables[group][patterns[:, group]]
            self.extreme += int(np.count_nonzero(np.abs(statistic) >= self.threshold))
            self.flips += rows

    def result(self) -> PValue:
        if self.exact_p is not None:
            return PValue(self.exact_p)
        # (1 + extreme) / (1 + flips) counts the observed pattern among the flips: a valid p-value at
        # any number of flips, never 0 (Phipson and Smyth 2010). Its error is binomial.
        p = (1 + self.extreme) / (1 + self.flips)
        return PValue(p, self.flips, float(np.sqrt(p * (1 - p) / self.flips)))


def sign_flip_test(per_task: dict[str, np.ndarray], flips: int = FLIPS,
                   clusters: dict[str, np.ndarray] | None = None) -> PValue:
    """Two-sided p-value of a paired difference (the mean over tasks of the per-task mean
    differences) under the null that each sample's difference is as likely negated.

    Only non-zero differences can change sign, so the statistic is sum_i s_i w_i d_i over the k
    non-zero differences d_i (weight w_i = 1 / (tasks x samples of d_i's task), s_i = +-1). When
    k <= ``EXACT_UP_TO`` all 2^k sign patterns are counted (``_enumerated_p``): p = (patterns at
    least as extreme) / 2^k, the exact permutation p-value. Otherwise ``flips`` random patterns
    (``_SignFlips``): p = (1 + flips at least as extreme) / (1 + flips), valid at any ``flips``,
    with its Monte Carlo standard error. All-zero differences give p = 1. With ``clusters``
    (``_units``) whole clusters are negated together: k counts non-zero clusters."""
    test = _SignFlips(per_task, clusters)
    if test.exact_p is None:
        test.draw(flips)
    return test.result()


def sign_flip_p(per_task: dict[str, np.ndarray], flips: int = FLIPS,
                clusters: dict[str, np.ndarray] | None = None) -> float:
    """``sign_flip_test``'s p-value alone."""
    return sign_flip_test(per_task, flips, clusters).p


def _rejected(p_values: list[float], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Which comparisons Holm and Benjamini-Hochberg reject at ``alpha`` (adjusted p < alpha, as
    the tables mark them)."""
    return np.asarray(holm(p_values)) < alpha, np.asarray(benjamini_hochberg(p_values)) < alpha


def _unsettled(values: list[PValue], alpha: float) -> tuple[set[int], set[int]]:
    """The comparisons whose Holm or BH decision is not settled, and the random p-values to refine.

    Both adjustments are monotone: raising any p-value never turns a non-rejection into a
    rejection. So a decision that is the same with every random p-value at its lower bound and
    with every one at its upper bound (``PValue.bounds``; exact ones fixed) is the same anywhere in
    between. An unsettled decision about comparison i depends on the p-values that can rank near
    it: Holm's (a step-down) on those that can come at or before p_i (lower bound <= i's upper
    bound), except those whose upper bound is below alpha / m, which pass every step of Holm
    wherever they rank; BH's (a step-up) on those that can come at or after p_i (upper bound >=
    i's lower bound), except those whose lower bound exceeds alpha, which pass no step of BH.
    Those, if random, are refined."""
    low, high = (np.asarray(side) for side in zip(*(v.bounds() for v in values)))
    holm_low, bh_low = _rejected(low.tolist(), alpha)
    holm_high, bh_high = _rejected(high.tolist(), alpha)
    random = np.array([not v.exact for v in values])
    refine = set()
    for i in np.flatnonzero(holm_low != holm_high):
        refine.update(np.flatnonzero(random & (low <= high[i]) & (high >= alpha / len(values))).tolist())
    for i in np.flatnonzero(bh_low != bh_high):
        refine.update(np.flatnonzero(random & (high >= low[i]) & (low <= alpha)).tolist())
    unsettled = set(np.flatnonzero((holm_low != holm_high) | (bh_low != bh_high)).tolist())
    return unsettled, refine


def settled_p_values(comparisons: list[dict[str, np.ndarray]], alpha: float = 1 - LEVEL,
                     start: list[int] | None = None, max_flips: int = MAX_FLIPS,
                     clusters: list[dict[str, np.ndarray] | None] | None = None) -> list[PValue]:
    """Sign-flip p-values of one family of comparisons (one table's), precise enough that the
    family's Holm and Benjamini-Hochberg decisions at ``alpha`` are settled.

    Each comparison's p is exact (``EXACT_UP_TO``) or from ``FLIPS`` random sign patterns (or
    ``start[i]``, to continue where another family left the same comparison). Then, while some
    decision is unsettled (``_unsettled``: it would differ with the random p-values at their
    lower bounds and at their upper bounds, +-``WIDTH`` standard errors), every random p-value it
    depends on gets ten times its flips, up to ``max_flips``. A p-value still unsettled there is
    marked ``settled=False``. That is rare: the p-values its mark depends on must lie within 4
    standard errors of 10^7 flips of where the mark changes (+-9% of p at p = 2e-4, +-1.3% at 0.01).
    ``clusters``: per comparison, its samples' cluster labels (``_units``) or None."""
    if not comparisons:
        return []
    clusters = clusters or [None] * len(comparisons)
    tests = [_SignFlips(per_task, labels) for per_task, labels in zip(comparisons, clusters)]
    for index, test in enumerate(tests):
        if test.exact_p is None:
            test.draw(max(FLIPS, start[index] if start else 0))
    while True:
        values = [test.result() for test in tests]
        unsettled, refine = _unsettled(values, alpha)
        refine = [i for i in sorted(refine) if tests[i].flips < max_flips]
        if not refine:
            break
        for i in refine:
            tests[i].draw(min(max_flips, 10 * tests[i].flips))
    return [replace(value, settled=index not in unsettled) for index, value in enumerate(values)]


# ---------------------------------------------------------------- intervals that agree with their test
_RESOLUTION = 2.0 ** -26  # a bound is bisected to this share of the differences' span: far below any kept decimal


def _pattern_sums(vectors: list[np.ndarray], bits: np.random.PCG64, count: int) -> list[np.ndarray]:
    """``count`` random sign patterns over the units, as each vector's signed sums (one array per
    vector, the same patterns for all): raw 64-bit words, a byte per 8 units, a table of each
    byte's 256 signed sums per group of 8 (as ``_SignFlips``), so a pattern costs units/8 look-ups."""
    k = len(vectors[0])
    groups, words = -(-k // 8), -(-k // 64)
    signs = 2 * ((np.arange(256)[:, None] >> np.arange(8)) & 1) - 1
    tables = []
    for vector in vectors:
        padded = np.zeros(8 * groups)
        padded[:k] = vector
        tables.append(padded.reshape(groups, 8) @ signs.T)
    sums = [np.zeros(count) for _ in vectors]
    for start in range(0, count, _FLIP_ROWS):
        rows = min(_FLIP_ROWS, count - start)
        patterns = bits.random_raw(rows * words).reshape(rows, words).view(np.uint8)
        for table, out in zip(tables, sums):
            part = table[0][patterns[:, 0]]
            for group in range(1, groups):
                part += table[group][patterns[:, group]]
            out[start:start + rows] = part
    return sums


def _bracketed(accepted, estimate: float, p_zero: float, side: int, span: float, alpha: float) -> float:
    """One end of the set of shifts the test does not reject, on ``side`` (-1 low, +1 high) of the
    estimate, by bisection between a shift the test accepts and one it rejects.

    Zero is decided by the reported p-value ``p_zero`` itself, never by a recomputation: when zero
    lies on this side and p_zero < alpha, zero is the rejected end of the bracket, so the bound
    lies strictly between the estimate and zero; when p_zero >= alpha, zero is the accepted end
    and the bound lies beyond it. So the interval excludes zero exactly when p_zero < alpha,
    whatever the test does at other shifts (its acceptance set need not be one interval)."""
    zero_here = (0.0 - estimate) * side > 0
    if zero_here and p_zero < alpha:
        inside, outside = estimate, 0.0
    else:
        inside = 0.0 if zero_here else estimate
        step = span
        outside = inside + side * step
        for _ in range(60):  # a shift past every difference leaves one pattern in 2^units as extreme
            if not accepted(outside):
                break
            step *= 2
            outside = inside + side * step
        else:
            return side * math.inf  # too few units for any shift to be rejected at alpha
    while abs(outside - inside) > _RESOLUTION * span:
        middle = (inside + outside) / 2
        if accepted(middle):
            inside = middle
        else:
            outside = middle
    return inside


def _round_bound(bound: float, digits: int) -> float:
    """A bound rounded to ``digits`` decimals, except that a non-zero bound never rounds to zero or
    past it: a bound of +0.003 printed as 0.00 would read as an interval touching zero beside
    p < 0.05. It becomes +-10^-digits instead (inward by less than the last printed digit)."""
    if not math.isfinite(bound):
        return bound
    rounded = _rounded(bound, digits)
    if bound != 0 and (rounded == 0 or (rounded > 0) != (bound > 0)):
        return math.copysign(10.0 ** -digits, bound)
    return rounded


def inverted_interval(per_task: dict[str, np.ndarray], p: PValue, *, scale: float = SCALE, digits: int = 2,
                  clusters: dict[str, np.ndarray] | None = None, alpha: float = 1 - LEVEL,
                  target: float | None = None, flips: int = FLIPS, max_flips: int = MAX_RESAMPLES) -> Interval:
    """The 95% interval of a paired difference that inverts its own sign-flip test: every shift s
    for which the test of the differences minus s (``sign_flip_test``, same statistic, same units,
    whole clusters with ``clusters``) does not reject at ``alpha``. ``p`` is that test's p-value
    at s = 0 as reported (settled over its family): the bracket starts from it (``_bracketed``),
    so the interval excludes zero if and only if p < alpha, by construction.

    Why not BCa here: a BCa bound over few differing samples is unreliable, and its interval and
    the test's p answered different questions, so 5% of committed comparisons printed an interval
    excluding zero beside p >= 0.05 or the reverse (issue 51). Shifted, every sample differs, so
    the shifted test enumerates every sign pattern where there are at most ``EXACT_UP_TO`` units
    (bounds exact, ``resamples`` 0); otherwise it uses random patterns from a generator seeded by
    the data (``data_seed``), the same patterns at every shift (a pattern's statistic is linear in
    s: A - s B), ``flips`` at first and more, doubling up to ``max_flips``, until the bounds' Monte
    Carlo error (sectioning: the bounds from ten disjoint tenths of the patterns) is below
    ``target`` (default ``mc_target(scale)``). ``Interval.resamples`` is then the patterns used."""
    values, weights = _units(per_task, clusters)
    estimate = float(values.sum())
    # Printed: the estimate as bca_interval computes it (scaled, then the mean over tasks of the task
    # means), so a table's differences keep the last digit they had; ``estimate`` (the same up to
    # rounding) centres the test.
    printed = float(np.mean([v.mean() for v in _arrays(per_task, scale)[1]]))
    samples = sum(len(np.asarray(v)) for v in per_task.values())
    if not np.any(values != 0):  # two runs equal on every sample: p = 1, and the interval is the point 0
        return Interval(0.0, 0.0, 0.0, samples)  # (as before: nothing to shift; it contains zero, as p says)
    span = float(np.max(np.abs(values / weights)) + abs(estimate)) or 1.0
    bounds: list[float]
    if len(values) <= EXACT_UP_TO:
        def accepted(shift: float) -> bool:
            shifted = values - shift * weights
            return _enumerated_p(shifted, abs(shifted.sum()) * (1 - 1e-9)) >= alpha
        bounds = [_bracketed(accepted, estimate, p.p, side, span, alpha) for side in (-1, 1)]
        error, used = 0.0, 0
    else:
        target = mc_target(scale) / scale if target is None else target / scale
        bits = np.random.PCG64(data_seed("test interval", [values, weights]))
        a, b = _pattern_sums([values, weights], bits, flips)
        total = float(weights.sum())

        def bounds_of(a_part: np.ndarray, b_part: np.ndarray) -> list[float]:
            def accepted(shift: float) -> bool:
                threshold = abs(estimate - shift * total) * (1 - 1e-9)
                extreme = np.count_nonzero(np.abs(a_part - shift * b_part) >= threshold)
                return (1 + extreme) / (1 + len(a_part)) >= alpha
            return [_bracketed(accepted, estimate, p.p, side, span, alpha) for side in (-1, 1)]

        while True:
            bounds = bounds_of(a, b)
            parts = np.array([bounds_of(x, y) for x, y in zip(np.array_split(a, SECTIONS), np.array_split(b, SECTIONS))])
            finite = parts[:, np.isfinite(parts).all(axis=0)]
            error = float(np.max(finite.std(axis=0, ddof=1)) / np.sqrt(SECTIONS)) if finite.size else 0.0
            if error < target or len(a) >= max_flips:
                break
            more = _pattern_sums([values, weights], bits, min(len(a), max_flips - len(a)))
            a, b = np.concatenate([a, more[0]]), np.concatenate([b, more[1]])
        error, used = error * scale, len(a)
    low, high = (_round_bound(scale * bound, digits) for bound in bounds)
    return Interval(_rounded(printed, digits), low, high, samples, round(error, digits + 2), used)


def cell_interval(per_task: dict[str, np.ndarray], *, scale: float = SCALE, digits: int = 2,
                  target: float | None = None, clusters: dict[str, np.ndarray] | None = None) -> Interval:
    """A 95% interval for one cell's value (the mean over tasks of the task means, x ``scale``).

    Independent samples: ``bca_interval``. Clustered samples (``clusters``, per task a label per
    sample): a bootstrap would have to resample the clusters, and with the few a workload has (four
    contexts per task in ``results/shared_context``) its distribution takes a handful of values and
    its percentiles come out far too narrow. Instead the interval inverts the one-sample sign-flip
    test over whole clusters (``inverted_interval`` of the values themselves: every m for which the
    clusters' deviations from m are as likely negated), exact up to ``EXACT_UP_TO`` clusters; it
    assumes the cluster means are spread symmetrically about their mean, which a mean over several
    samples per cluster approaches."""
    if clusters is None:
        return bca_interval(per_task, scale=scale, digits=digits, target=target)
    return inverted_interval(per_task, sign_flip_test(per_task, clusters=clusters), scale=scale, digits=digits,
                             clusters=clusters, target=target)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment (family-wise error): the i-th smallest p times (m - i),
    made monotone, capped at 1; in the input's order."""
    m = len(p_values)
    order = np.argsort(p_values, kind="stable")
    adjusted, running = np.empty(m), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted.tolist()


def benjamini_hochberg(p_values: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (false discovery rate), in the input's order."""
    m = len(p_values)
    order = np.argsort(p_values, kind="stable")
    adjusted, running = np.empty(m), 1.0
    for rank in range(m - 1, -1, -1):
        index = order[rank]
        running = min(running, p_values[index] * m / (rank + 1))
        adjusted[index] = min(running, 1.0)
    return adjusted.tolist()


def standard_error(per_task: dict[str, np.ndarray], scale: float = SCALE) -> float:
    """Standard error of the mean over tasks of the task means (x ``scale``), from the observed
    per-task variances (tasks independent, each mean's variance s^2 / n)."""
    tasks, values = _arrays(per_task, scale)
    variance = sum(np.var(v, ddof=1) / len(v) for v in values if len(v) > 1) / len(tasks) ** 2
    return float(np.sqrt(variance))


def detectable_difference(per_task: dict[str, np.ndarray], alpha: float = 1 - LEVEL, power: float = 0.8,
                          scale: float = SCALE) -> float:
    """The smallest paired difference of the average (x ``scale``) that a two-sided test at
    ``alpha`` detects with probability ``power``, from the observed per-task variances of the
    differences (normal approximation: (z_{1-alpha/2} + z_power) x its standard error)."""
    return float((_NORMAL.inv_cdf(1 - alpha / 2) + _NORMAL.inv_cdf(power)) * standard_error(per_task, scale))

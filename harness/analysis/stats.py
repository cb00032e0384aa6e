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
from dataclasses import dataclass, field, replace
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
EXACT_UP_TO = 20  # units (samples, or clusters) up to which every sign pattern is enumerated (2^20: about 0.1 s)
FLIPS = 10_000  # random sign patterns a Monte Carlo p-value starts from
MAX_FLIPS = 10_000_000  # ... and may be refined to (settled_p_values)
WIDTH = 4  # Monte Carlo standard errors either side of a p-value within which its marks must hold
_FLIP_ROWS = 1 << 14  # random sign patterns evaluated at once (bounds memory: rows x units floats)
# |Z*| from which a test keeps its first MAX_RESAMPLES draws for its interval (``_Stratified.tail_critical``):
# P(|Z*| >= 1.5) is about 13% for a standard normal Z*, while a critical value at the 5% level
# needs the top 5% of the draws, so the tail holds every draw a critical value is read from (and
# a fifth of the memory of all the draws); where it does not, the interval draws them all again.
TAIL_FROM = 1.5


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
    critical: float | None = None  # exact tests: the critical |Z| at the 5% level, so the interval needs no recount
    # Random tests: the test itself, whose kept tail of draws (``_Stratified.tail_critical``) gives the
    # interval its critical values without drawing the same patterns again (not part of the value).
    test: "_Stratified | None" = field(default=None, compare=False, repr=False)

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
    values, weights, _ = _strata_units(per_task, clusters)
    return values, weights


def _strata_units(per_task: dict[str, np.ndarray], clusters: dict[str, np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_units`` with each unit's stratum: the index of its task (in sorted order), or, for a
    cluster whose samples come from several tasks, one further stratum shared by all such clusters."""
    tasks = sorted(per_task)
    values, weights, labels, task_of = [], [], [], []
    for index, task in enumerate(tasks):
        d = np.asarray(per_task[task], dtype=float)
        weights.append(np.full(len(d), 1.0 / (len(d) * len(tasks))))
        values.append(d / (len(d) * len(tasks)))
        task_of.append(np.full(len(d), index))
        if clusters is not None:
            label = np.asarray(clusters[task], dtype=object)
            if len(label) != len(d):
                raise ValueError(f"{task}: {len(label)} cluster labels for {len(d)} samples")
            labels.extend(str(x) for x in label)
    if not values:
        return np.zeros(0), np.zeros(0), np.zeros(0, dtype=int)
    values, weights, task_of = np.concatenate(values), np.concatenate(weights), np.concatenate(task_of)
    if clusters is None:
        return values, weights, task_of
    names, index = np.unique(np.asarray(labels), return_inverse=True)
    low = np.full(len(names), len(tasks))
    high = np.full(len(names), -1)
    np.minimum.at(low, index, task_of)
    np.maximum.at(high, index, task_of)
    strata = np.where(low == high, low, len(tasks))  # a cluster spanning tasks: the mixed stratum
    return (np.bincount(index, weights=values, minlength=len(names)),
            np.bincount(index, weights=weights, minlength=len(names)), strata)


def _weighted(per_task: dict[str, np.ndarray], clusters: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The non-zero units' values (``_units``): the units on which the two runs differ."""
    values = _units(per_task, clusters)[0]
    return values[values != 0]


class _Stratified:
    """The stratified, studentized sign-flip test of one comparison (issue 65, item 3).

    Units (samples, or whole clusters) with values c_j (``_strata_units``: differences weighted so
    that their sum is the estimate, the mean over tasks of the task means), weights b_j (summing to
    1) and strata (tasks). Within each stratum the units are centred on the stratum's own mean:
    r_j = c_j - b_j x (sum of the stratum's c / sum of its b), the part of each unit that the
    stratum's mean does not explain. The estimate's standard error is the stratified one,
    V = sum over strata of m/(m-1) x sum r_j^2 (m units in the stratum; for samples, the textbook
    sum_t s_t^2 / (tasks^2 n_t)), and the test statistic of a shift s (the hypothesis: the mean
    difference is s) is Z(s) = (estimate - s) / sqrt(V).

    Its reference distribution flips the signs of the centred units within their strata: for a
    sign pattern e, Z* = sum e_j r_j / sqrt(V*(e)), V* the same stratified variance of the flipped
    units e_j r_j. That distribution does not depend on s (a shift moves every unit of a stratum
    by its weight, which centring removes), so:

    * every unit takes part in the same way at every shift, zero differences included (a sample
      on which the two runs agree is a unit like any other; before, it dropped out at s = 0 and
      took part at every other shift, and the interval ended exactly at 0);
    * the strata are respected: the spread of the task means around the overall mean does not
      widen the reference distribution (it did, by 12% typically, up to 2x), and with many units
      Z* tends to the standard normal, so the interval tends to the stratified t-interval;
    * the test accepts s exactly when |Z(s)| <= the critical value of |Z*|, so the interval that
      inverts it is estimate -+ critical x sqrt(V), in closed form, and it excludes zero exactly
      when the p-value at zero is below the level (the same comparison of |Z(0)| with the same
      draws of |Z*|).

    p(s) = (1 + #{patterns with |Z*| >= |Z(s)|}) / (1 + patterns): every pattern of up to
    ``EXACT_UP_TO`` units enumerated (no Monte Carlo error), else random patterns from a generator
    seeded by the data (``data_seed``), valid at any number of them (Phipson and Smyth 2010). This
    is the wild (Rademacher) bootstrap-t test of a mean, stratified and clustered (Cameron,
    Gelbach and Miller 2008 for few clusters): not exact in finite samples as a permutation test
    of a sharp null is, but right for the hypothesis the tables state (a mean difference), and
    checked for coverage by simulation (tests/unit/test_stats.py)."""

    def __init__(self, per_task: dict[str, np.ndarray], clusters: dict[str, np.ndarray] | None = None,
                 keep: bool = True, count: bool = True, tail: bool = False):
        values, weights, strata = _strata_units(per_task, clusters)
        self.keep = keep  # keep the draws of |Z*| (an interval's critical value needs them; a p-value does not)
        # ``tail``: keep, of the first MAX_RESAMPLES draws, those of at least TAIL_FROM and their
        # positions (what ``inverted_interval`` reads its critical values from: ``tail_critical``).
        self.tail_until = MAX_RESAMPLES if tail else 0
        self.tail_values: list[np.ndarray] = []
        self.tail_positions: list[np.ndarray] = []
        self.units = len(values)
        self.estimate = float(values.sum())
        self.flips = self.extreme = 0
        self.multiplicity = 1  # patterns each draw stands for (2 when enumerated: a pattern and its negation)
        self.draws: list[np.ndarray] = []
        # Strata of one unit cannot estimate a spread: they are pooled into one stratum.
        names, index, counts = np.unique(strata, return_inverse=True, return_counts=True)
        single = counts[index] == 1
        if single.sum() >= 2:
            index = np.where(single, len(names), index)
            names, index = np.unique(index, return_inverse=True)
        self.strata = index
        counting, count = count, np.bincount(index).astype(float)
        mean = np.bincount(index, weights=values) / np.bincount(index, weights=weights)
        self.residuals = values - weights * mean[index]
        self.factor = np.where(count > 1, count / np.maximum(count - 1, 1), 0.0)  # m / (m - 1) per stratum
        self.count = count
        self.q = np.bincount(index, weights=self.residuals ** 2, minlength=len(count))  # flip-invariant
        self.variance = float(np.sum(self.factor * self.q))
        self.exact_p = self.exact_critical = None
        if not counting:
            return  # the estimate and its standard error alone (an interval whose critical value is known)
        if not np.any(values != 0):
            self.exact_p, self.observed = 1.0, 0.0  # two runs equal on every unit: nothing to test
            return
        if self.variance <= 1e-30 * max(1.0, self.estimate ** 2):
            # Every unit differs by its weight times one common value (every sample -1, say): no
            # spread to test against. The estimate is then what every unit says; p as small as
            # the design allows, the interval the estimate itself.
            self.observed = math.inf
        else:
            self.observed = abs(self.estimate) / math.sqrt(self.variance)
        self.threshold = self.observed * (1 - 1e-9)  # ties up to rounding count as extreme
        self.matrix = np.zeros((self.units, len(count)))
        self.matrix[np.arange(self.units), index] = self.residuals  # unit -> its stratum's column
        if self.units <= EXACT_UP_TO:
            self.multiplicity = 2
            z = self._enumerated()
            self.extreme = 2 * int(np.count_nonzero(z >= self.threshold))
            self.exact_p = (1 + self.extreme) / (1 + 2 ** self.units)
            self.draws = [z]
            self.exact_critical = self.critical(1 - LEVEL)  # carried by the p-value to its interval
            if not keep:
                self.draws = []
            return
        # Random patterns as bytes: each stratum's units in groups of 8 (the last padded with zeros,
        # whose signs change nothing), a 256-entry table per group holding each byte's signed sum
        # of its 8 residuals, so a pattern's per-stratum sums are one table look-up per group.
        signs = 2 * ((np.arange(256)[:, None] >> np.arange(8)) & 1) - 1  # byte value -> its 8 signs
        tables, self.first_group, self.groups = [], [], []  # per stratum: its first group, its groups
        for stratum in range(len(count)):
            mine = self.residuals[index == stratum]
            padded = np.zeros(8 * -(-len(mine) // 8))
            padded[:len(mine)] = mine
            self.first_group.append(len(tables))
            self.groups.append(len(padded) // 8)
            tables.extend(padded.reshape(-1, 8) @ signs.T)
        self.tables = np.asarray(tables)
        self.words = -(-len(self.tables) // 8)  # 64-bit words per pattern: a byte per group
        # Seeded by the values (the data and its negation alike: B minus A draws A minus B's patterns)
        # and, apart, by the weights (always positive).
        self.seed = data_seed("stratified sign flips", [values]) ^ data_seed("weights", [weights])
        self.bits = np.random.PCG64(self.seed)

    def _pair_tables(self) -> list[np.ndarray | None]:
        """Per stratum of at least two groups, its first two groups looked up at once: a 65,536-entry
        table (512 KB) indexed by their two bytes read as one little-endian 16-bit number, holding
        (0 + first) + second, the very additions (in their order) the per-group look-ups make, so
        the sums are unchanged. Built by each ``draw`` that draws enough patterns to repay it, and
        not kept (a family of hundreds of tests would hold hundreds of them)."""
        return [((0.0 + self.tables[g])[None, :] + self.tables[g + 1][:, None]).ravel() if size >= 2 else None
                for g, size in zip(self.first_group, self.groups)]

    def same_patterns(self, other: "_Stratified") -> bool:
        """Whether ``other`` flips the same units with the same generator (the same test)."""
        seed = getattr(self, "seed", None)  # random tests only
        return (seed is not None and getattr(other, "seed", None) == seed
                and np.array_equal(other.residuals, self.residuals) and np.array_equal(other.strata, self.strata))

    def _statistics(self, patterns: np.ndarray) -> np.ndarray:
        """|Z*| of each sign pattern (rows of +-1 over the units)."""
        sums = patterns @ self.matrix  # per pattern and stratum: sum of e_j r_j
        variance = np.sum(self.factor * (self.q - sums ** 2 / self.count), axis=1)
        return self._z(sums.sum(axis=1), variance)

    @staticmethod
    def _z(total: np.ndarray, variance: np.ndarray) -> np.ndarray:
        """|total| / sqrt(variance), 0 where |total| is 0 up to rounding. Overwrites both arguments
        (the callers' temporaries: no new arrays of a million patterns each)."""
        total = np.abs(total, out=total)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.divide(total, np.sqrt(np.maximum(variance, 0.0, out=variance), out=variance), out=variance)
        z[total <= 1e-15] = 0.0  # 0/0: a pattern whose flipped units cancel says nothing
        return z

    def _enumerated(self) -> np.ndarray:
        """|Z*| of the 2^(units - 1) sign patterns whose first unit keeps its sign, each standing for
        itself and its negation (``multiplicity`` 2). The sum and the variance are sums over strata
        of what each stratum's own signs give, so each stratum's signed sums are listed and the
        strata combined by outer sums: about 2^units additions, no pattern matrix."""
        total, variance = np.zeros(1), np.zeros(1)
        first = True  # a pattern and its negation give the same |Z*|: the first unit's sign is fixed at +
        for stratum in range(len(self.count)):
            mine = self.residuals[self.strata == stratum]
            # The signed sums, doubled in place: [s + r, s - r] of the sums s so far, per residual r.
            sums = np.zeros(2 ** (len(mine) - 1 if first else len(mine)))
            size = 1
            for r in mine:
                if first:
                    sums[0] += r
                    first = False
                    continue
                np.subtract(sums[:size], r, out=sums[size:2 * size])
                np.add(sums[:size], r, out=sums[:size])
                size *= 2
            part = np.square(sums)
            np.divide(part, self.count[stratum], out=part)
            np.subtract(self.q[stratum], part, out=part)
            np.multiply(self.factor[stratum], part, out=part)
            if len(total) == 1:  # the outer sum with the single 0 so far: 0 + each value, the same additions
                total, variance = np.add(total[0], sums, out=sums), np.add(variance[0], part, out=part)
            else:
                total = (total[:, None] + sums[None, :]).ravel()
                variance = (variance[:, None] + part[None, :]).ravel()
        return self._z(total, variance)

    def _add(self, z: np.ndarray) -> None:
        if self.keep:
            self.draws.append(z)
        if self.flips < self.tail_until:
            kept = np.flatnonzero(z[:self.tail_until - self.flips] >= TAIL_FROM)
            self.tail_values.append(z[kept])
            self.tail_positions.append((kept + self.flips).astype(np.int32))  # < MAX_RESAMPLES
        self.extreme += self.multiplicity * int(np.count_nonzero(z >= self.threshold))
        self.flips += len(z)

    def draw(self, flips: int) -> None:
        """Draw random sign patterns until ``flips`` have been drawn in all: raw 64-bit words from
        the data-seeded generator, a byte per group of 8 units (``tables``), so the first N
        patterns are the same however the drawing was split."""
        if self.exact_p is not None:
            return
        strata = len(self.count)
        # Pair tables (``_pair_tables``) save a look-up per stratum and block: worth building from
        # about six blocks on.
        pairs = self._pair_tables() if flips - self.flips >= 8 * _FLIP_ROWS else [None] * strata
        while self.flips < flips:
            rows = min(_FLIP_ROWS, flips - self.flips)
            patterns = self.bits.random_raw(rows * self.words).reshape(rows, self.words).view(np.uint8)
            # Per stratum, its groups' look-ups added in group order into one contiguous column
            # (np.take: twice as fast as indexing with the strided byte column).
            columns = []
            for stratum in range(strata):
                first, size = self.first_group[stratum], self.groups[stratum]
                if pairs[stratum] is not None:  # the first two bytes as one 16-bit index into their pair table
                    pair = np.ndarray((rows,), dtype="<u2", buffer=patterns, offset=first,
                                      strides=(patterns.strides[0],))
                    column = np.take(pairs[stratum], pair)
                    start = first + 2
                else:
                    column = np.zeros(rows)
                    start = first
                for group in range(start, first + size):
                    column += np.take(self.tables[group], patterns[:, group])
                columns.append(column)
            # Each stratum's term of the variance, factor x (q - sums^2 / m), then both sums over the
            # strata. np.sum over the short last axis of a (rows x strata) array adds left to right
            # when there are fewer than 8 strata (numpy's pairwise sum unrolls from 8 on, in another
            # order; tests/unit/test_stats.py checks the order): added column by column here in that
            # order, the same numbers at a fraction of the cost.
            if strata < 8:
                variance = None
                for s, column in enumerate(columns):  # in place: the same operations, no temporaries
                    term = np.square(column)
                    term /= self.count[s]
                    np.subtract(self.q[s], term, out=term)
                    term *= self.factor[s]
                    if variance is None:
                        variance = term
                    else:
                        variance += term
                total = columns[0]
                for column in columns[1:]:
                    total += column
            else:
                sums = np.stack(columns, axis=1)
                variance = np.sum(self.factor * (self.q - sums ** 2 / self.count), axis=1)
                total = sums.sum(axis=1)
            self._add(self._z(total, variance))

    def result(self) -> PValue:
        if self.exact_p is not None:
            return PValue(self.exact_p, critical=self.exact_critical)
        p = (1 + self.extreme) / (1 + self.flips)
        return PValue(p, self.flips, float(np.sqrt(p * (1 - p) / self.flips)), test=self if self.tail_until else None)

    def _needed(self, alpha: float, draws: int) -> int:
        """How many of ``draws`` draws must reach |Z| for it to be accepted at ``alpha`` (``critical``)."""
        # patterns at least as large, for acceptance, then the draws that stand for them
        needed = math.ceil(alpha * (1 + self.multiplicity * draws) - 1e-12) - 1
        return -(-needed // self.multiplicity) if needed > 0 else needed

    def critical(self, alpha: float, draws: np.ndarray | None = None) -> float:
        """The largest |Z| the test accepts at ``alpha`` over ``draws`` (default: all): accepted
        when (1 + #{|Z*| >= |Z|}) / (1 + N) >= alpha, i.e. when at least ceil(alpha (1 + N)) - 1
        draws reach |Z|; the critical value is that order statistic of the draws (infinite when the
        design has too few patterns for any |Z| to be rejected)."""
        z = (self.draws[0] if len(self.draws) == 1 else np.concatenate(self.draws)) if draws is None else draws
        needed = self._needed(alpha, len(z))
        if needed <= 0:
            return math.inf
        if needed > len(z):
            return 0.0  # (cannot happen at alpha < 1) no |Z| is accepted
        # The needed-th largest draw (a partial sort: linear, not a sort of every draw).
        return float(np.partition(z, len(z) - needed)[len(z) - needed]) / (1 - 1e-9)  # ``threshold``'s tolerance

    def tail_critical(self, alpha: float, start: int, stop: int) -> float | None:
        """``critical(alpha, draws[start:stop])`` of the draws so far, read from the tail alone (it
        holds every draw of at least TAIL_FROM among the first MAX_RESAMPLES): the same order
        statistic, so the same number, whenever at least the needed count of those draws is in the
        tail; None when it is not (or the range reaches past the tail)."""
        if stop > min(self.flips, self.tail_until):
            return None
        needed = self._needed(alpha, stop - start)
        if needed <= 0:
            return math.inf
        if needed > stop - start:
            return 0.0
        if len(self.tail_values) > 1:  # once, then kept as one array
            self.tail_values = [np.concatenate(self.tail_values)]
            self.tail_positions = [np.concatenate(self.tail_positions)]
        values, positions = self.tail_values[0], self.tail_positions[0]
        z = values[np.searchsorted(positions, start):np.searchsorted(positions, stop)]
        if len(z) < needed:
            return None
        return float(np.partition(z, len(z) - needed)[len(z) - needed]) / (1 - 1e-9)  # ``critical``'s


def sign_flip_test(per_task: dict[str, np.ndarray], flips: int = FLIPS,
                   clusters: dict[str, np.ndarray] | None = None) -> PValue:
    """Two-sided p-value of a paired difference (the mean over tasks of the per-task mean
    differences) being zero: the stratified, studentized sign-flip test (``_Stratified``). Exact
    (every pattern) for at most ``EXACT_UP_TO`` units, else from ``flips`` random patterns with
    the p-value's Monte Carlo standard error. All-zero differences give p = 1. With ``clusters``
    whole clusters are flipped together (a unit is a cluster)."""
    test = _Stratified(per_task, clusters, keep=False, tail=True)
    test.draw(flips)
    return test.result()


def sign_flip_p(per_task: dict[str, np.ndarray], flips: int = FLIPS,
                clusters: dict[str, np.ndarray] | None = None) -> float:
    """``sign_flip_test``'s p-value alone."""
    return sign_flip_test(per_task, flips, clusters).p


def smallest_p(units: int) -> float:
    """The smallest p-value a comparison of ``units`` units (samples, or clusters) can reach:
    1 / (1 + 2^units) where every pattern is enumerated, 1 / (1 + ``MAX_FLIPS``) otherwise."""
    return 1 / (1 + 2 ** units) if units <= EXACT_UP_TO else 1 / (1 + MAX_FLIPS)


def can_decide(units: list[int], alpha: float = 1 - LEVEL) -> bool:
    """Whether a family of comparisons with these unit counts can reject anything under Holm at
    ``alpha``: its smallest attainable p times the family size must be below ``alpha``."""
    return bool(units) and min(smallest_p(u) for u in units) * len(units) < alpha


def fewest_units_to_decide(family_size: int, alpha: float = 1 - LEVEL) -> int:
    """The fewest units (samples, or clusters) per comparison with which a family of
    ``family_size`` comparisons can reject anything under Holm at ``alpha`` (``can_decide``):
    ``family_size`` / (1 + 2^units) < ``alpha``."""
    for units in range(1, EXACT_UP_TO + 2):
        if can_decide([units] * max(1, family_size), alpha):
            return units
    raise ValueError(f"no count of units lets a family of {family_size} reach {alpha} with {MAX_FLIPS} flips")


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
    tests = [_Stratified(per_task, labels, keep=False, tail=True) for per_task, labels in zip(comparisons, clusters)]
    for index, test in enumerate(tests):
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


def _critical_values(test: _Stratified, source: _Stratified | None, alpha: float, flips: int
                     ) -> tuple[float, list[float]]:
    """The critical value at ``alpha`` of the first ``flips`` draws and of the ``SECTIONS`` parts
    np.array_split cuts them into (the first flips % SECTIONS parts one draw longer): from
    ``source``'s tail (``_Stratified.tail_critical``, drawing it on to ``flips``) where it holds
    them all, else from ``test``'s own draws (kept, drawn to ``flips``)."""
    if source is not None:
        source.draw(flips)
        size, extra = divmod(flips, SECTIONS)
        edges = np.cumsum([0] + [size + 1] * extra + [size] * (SECTIONS - extra)).tolist()
        values = [source.tail_critical(alpha, 0, flips)] + [source.tail_critical(alpha, start, stop)
                                                             for start, stop in zip(edges[:-1], edges[1:])]
        if all(value is not None for value in values):
            return values[0], values[1:]
    test.draw(flips)
    draws = np.concatenate(test.draws)
    return test.critical(alpha, draws), [test.critical(alpha, part) for part in np.array_split(draws, SECTIONS)]


def inverted_interval(per_task: dict[str, np.ndarray], p: PValue, *, scale: float = SCALE, digits: int = 2,
                      clusters: dict[str, np.ndarray] | None = None, alpha: float = 1 - LEVEL,
                      target: float | None = None, flips: int = FLIPS, max_flips: int = MAX_RESAMPLES,
                      bounds: tuple[float, float] = (-math.inf, math.inf)) -> Interval:
    """The 95% interval of a paired difference that inverts its own test (``_Stratified``): every
    shift s the stratified sign-flip test of "the mean difference is s" does not reject at
    ``alpha``, which is estimate -+ critical |Z*| x stratified standard error.

    The draws of |Z*| are the test's own: all patterns where there are at most ``EXACT_UP_TO``
    units (bounds exact, ``resamples`` 0), else the same data-seeded patterns as the p-value
    ``p`` (its ``flips``, at least ``flips``, at most ``max_flips``) and more, doubling up to
    ``max_flips``, while the
    bounds' Monte Carlo error (sectioning: the critical value from ten disjoint tenths of the
    draws) is at or above ``target`` (default ``mc_target(scale)``). The interval excludes zero
    exactly when ``p`` < ``alpha``: with the p-value's own draws that holds by construction; where
    more draws moved the critical value across |Z(0)| (within Monte Carlo error of the level) the
    bound on zero's side is set at zero's side that ``p`` says, and ``Interval.mc_error`` covers it.

    ``bounds``: the range the differences lie in, in their own units ((-1, 1) for scores in [0, 1]);
    the interval is intersected with it (``within``). With few clusters the studentized draws can be
    unbounded (a pattern whose flipped deviations all agree has no spread) and the interval
    infinite, or far wider than any difference can be."""
    known = p.critical is not None and alpha == 1 - LEVEL  # an exact test's, computed with the p-value
    test = _Stratified(per_task, clusters, count=not known)
    printed = float(np.mean([v.mean() for v in _arrays(per_task, scale)[1]]))
    samples = sum(len(np.asarray(v)) for v in per_task.values())
    if not any(np.any(np.asarray(v) != 0) for v in per_task.values()):  # equal on every unit: the point 0
        return Interval(0.0, 0.0, 0.0, samples)
    se = math.sqrt(test.variance)
    error, used = 0.0, 0
    if known:
        critical = p.critical
    elif test.exact_p is None:
        target = mc_target(scale) / scale if target is None else target / scale
        # The p-value's own test, where it came with one (``settled_p_values``, ``sign_flip_test``):
        # its tail holds the draws the critical values are read from, so they are not drawn again.
        source = p.test if p.test is not None and max_flips <= p.test.tail_until and p.test.same_patterns(test) else None
        used = max(flips, min(p.flips, max_flips))
        while True:
            critical, parts = _critical_values(test, source, alpha, used)
            finite = [c for c in parts if math.isfinite(c)]
            error = float(np.std(finite, ddof=1) / np.sqrt(SECTIONS) * se) if len(finite) > 1 else 0.0
            if error < target or used >= max_flips:
                break
            used = min(max_flips, 2 * used)
        error = error * scale
    else:
        critical = test.critical(alpha)
    half = critical * se
    low, high = test.estimate - half, test.estimate + half
    # The side of zero the reported p says (the same comparison, |Z(0)| against the critical value,
    # unless more draws or the family's refinement moved one across the other).
    if p.p < alpha and low <= 0 <= high:
        low, high = (low, -abs(test.estimate) * 1e-9) if test.estimate < 0 else (abs(test.estimate) * 1e-9, high)
    elif p.p >= alpha and not low <= 0 <= high:
        low, high = (low, 0.0) if high < 0 else (0.0, high)
    low, high = (_round_bound(scale * bound, digits) for bound in (low, high))
    return within(Interval(_rounded(printed, digits), low, high, samples, round(error, digits + 2), used),
                  bounds, scale)


def within(interval: Interval, bounds: tuple[float, float], scale: float) -> Interval:
    """``interval`` intersected with ``bounds`` (the range of the values it is about, in their own
    units; ``scale`` puts them in the interval's). A mean of values in [a, b] lies in [a, b], so the
    intersection covers as often as the interval did, and where the interval excludes zero and the
    range includes it, so does the intersection: it still agrees with its test."""
    low_bound, high_bound = (scale * b if math.isfinite(b) else b for b in bounds)
    return replace(interval, low=min(max(interval.low, low_bound), high_bound),
                   high=max(min(interval.high, high_bound), low_bound))


def cell_interval(per_task: dict[str, np.ndarray], *, scale: float = SCALE, digits: int = 2,
                  target: float | None = None, clusters: dict[str, np.ndarray] | None = None,
                  bounds: tuple[float, float] = (-math.inf, math.inf)) -> Interval:
    """A 95% interval for one cell's value (the mean over tasks of the task means, x ``scale``).

    Independent samples: ``bca_interval``. Clustered samples (``clusters``, per task a label per
    sample): a bootstrap would have to resample the clusters, and with the few a workload has (four
    contexts per task in ``results/shared_context``) its distribution takes a handful of values and
    its percentiles come out far too narrow. Instead the interval inverts the stratified sign-flip
    test over whole clusters (``inverted_interval`` of the values themselves: every m for which
    the studentized mean minus m is not extreme among the clusters' centred deviations flipped
    within their tasks).

    ``bounds``: the range every value lies in, in the values' own units (a score's (0, 1)). The
    interval is intersected with it, ``scale`` applied: the mean of values in [a, b] lies in [a, b],
    so the intersection covers as often as the interval did. It matters for the clustered
    interval, which is symmetric about the estimate and unbounded where the clusters are too few
    for it (a task whose flipped deviations can all agree has no spread in that pattern): there it
    is the whole range, which says nothing and reads so, where it would print -inf, inf or a
    negative score."""
    if clusters is None:
        return within(bca_interval(per_task, scale=scale, digits=digits, target=target), bounds, scale)
    return inverted_interval(per_task, sign_flip_test(per_task, clusters=clusters), scale=scale, digits=digits,
                             clusters=clusters, target=target, bounds=bounds)


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


def stratified_t_interval(per_task: dict[str, np.ndarray], scale: float = SCALE) -> Interval:
    """The reference the sign-flip interval is checked against (tests/unit/test_stats.py): the
    estimate -+ t x the stratified standard error, t with Welch-Satterthwaite degrees of freedom."""
    tasks, values = _arrays(per_task, scale)
    estimate = float(np.mean([v.mean() for v in values]))
    parts = np.array([np.var(v, ddof=1) / len(v) / len(tasks) ** 2 if len(v) > 1 else 0.0 for v in values])
    se = float(np.sqrt(parts.sum()))
    df_parts = [part ** 2 / (len(v) - 1) for part, v in zip(parts, values) if len(v) > 1]
    df = max(1, int(round(parts.sum() ** 2 / sum(df_parts)))) if se > 0 and sum(df_parts) > 0 else 1
    half = t_975(df) * se
    return Interval(estimate, estimate - half, estimate + half, sum(len(v) for v in values))

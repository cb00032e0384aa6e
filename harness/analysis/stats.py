"""How sure a number is: seeded bootstrap intervals, paired sign-flip tests and their adjustment.

Everything works on per-sample values grouped by task (``{task: array}``) and on one statistic:
the unweighted mean over tasks of the task means (a task's own mean when there is one task),
times ``scale`` (100 puts scores in [0, 1] on LongBench's 0-100 scale; 1 leaves a quantity such as
a log-likelihood in its own units). A paired difference is the same statistic of the per-sample
differences of two runs on the same samples, so the noise both runs share (an easy or a hard
sample) cancels.

* Resampling: for each task in sorted order, ``RESAMPLES`` resamples of its samples with
  replacement from one ``numpy`` generator seeded ``SEED``; the statistic of each resample
  (tasks are resampled within themselves, as the average weighs them equally).
* Intervals: ``bca_interval`` (bias-corrected and accelerated, Efron 1987) is what the summaries
  print. The plain percentile interval (``intervals``) is too narrow for skewed 0/1 scores at 20
  samples per task; BCa corrects its coverage to second order.
* Tests: ``sign_flip_p`` is the two-sided paired permutation test (each sample's difference is
  as likely negated under the null); exact by enumeration when few differences are non-zero.
* A table's comparisons form one family: ``holm`` (family-wise error) and ``benjamini_hochberg``
  (false discovery rate) adjust its p-values; ``detectable_difference`` is the smallest true
  difference a comparison finds with 80% power at a given level.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
SCALE = 100  # scores in [0, 1] are reported on LongBench's 0-100 scale

_NORMAL = NormalDist()


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    samples: int

    @property
    def significant(self) -> bool:
        """For a difference: the interval excludes zero."""
        return self.low > 0 or self.high < 0

    def negated(self) -> "Interval":
        """The same interval for the difference taken the other way round (B minus A). Exact for
        both interval methods here: negating every sample negates every resampled statistic, the
        median bias and the skew, so the bounds swap and change sign."""
        return Interval(0.0 - self.estimate, 0.0 - self.high, 0.0 - self.low, self.samples)


def _arrays(per_task: dict[str, np.ndarray], scale: float) -> tuple[list[str], list[np.ndarray]]:
    tasks = sorted(per_task)
    return tasks, [scale * np.asarray(per_task[t], dtype=float) for t in tasks]


def bootstrap(per_task: dict[str, np.ndarray], resamples: int = RESAMPLES, seed: int = SEED,
              scale: float = SCALE) -> dict[str, np.ndarray]:
    """Per task, ``resamples`` resampled means x ``scale``."""
    rng = np.random.default_rng(seed)
    means = {}
    for task, values in zip(*_arrays(per_task, scale)):
        draws = rng.integers(0, len(values), size=(resamples, len(values)))
        means[task] = values[draws].mean(axis=1)
    return means


def _rounded(value: float, digits: int = 2) -> float:
    return round(float(value), digits) + 0.0  # + 0.0: a bound that rounds to -0.0 prints as 0.00, not "-0.00"


def _interval(estimate: float, draws: np.ndarray, samples: int) -> Interval:
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    return Interval(_rounded(estimate), _rounded(low), _rounded(high), samples)


def intervals(per_task: dict[str, np.ndarray], scale: float = SCALE) -> tuple[dict[str, Interval], Interval]:
    """Percentile intervals: each task's and the average's (mean of the task means). Kept for
    callers that want the plain bootstrap; the summaries use ``bca_interval``."""
    draws = bootstrap(per_task, scale=scale)
    tasks = {task: _interval(scale * np.mean(per_task[task]), draws[task], len(per_task[task])) for task in draws}
    average_draws = np.mean([draws[task] for task in draws], axis=0)
    average = _interval(np.mean([scale * np.mean(per_task[t]) for t in draws]), average_draws,
                        sum(len(v) for v in per_task.values()))
    return tasks, average


def bca_interval(per_task: dict[str, np.ndarray], resamples: int = RESAMPLES, seed: int = SEED,
                 scale: float = SCALE, digits: int = 2) -> Interval:
    """A bias-corrected and accelerated (BCa) 95% interval for the mean over tasks of the task
    means (x ``scale``, rounded to ``digits`` decimals), from the same stratified bootstrap draws as ``intervals``: the percentile
    interval shifted by the draws' median bias (z0) and widened by the skew the jackknife
    measures (acceleration a; Efron 1987). With 20 samples the percentile interval is too
    narrow for skewed 0/1 scores; BCa corrects that to second order."""
    tasks, values = _arrays(per_task, scale)
    estimate = float(np.mean([v.mean() for v in values]))
    draws = np.mean(list(bootstrap(per_task, resamples, seed, scale).values()), axis=0)
    samples = sum(len(v) for v in values)
    if np.all(draws == draws[0]):
        return Interval(*[_rounded(estimate, digits)] * 3, samples)
    # Draws equal to the estimate up to summation order are ties (F1 scores, 1/3, 0.1 are not
    # exact binary fractions; exact equality would misclassify them and shift z0).
    tie = np.abs(draws - estimate) <= 1e-9 * max(1.0, abs(estimate))
    below = (np.sum((draws < estimate) & ~tie) + 0.5 * np.sum(tie)) / len(draws)
    below = min(max(below, 1 / (len(draws) + 1)), len(draws) / (len(draws) + 1))
    z0 = _NORMAL.inv_cdf(below)
    # Jackknife: leave one sample out of its task, recompute the statistic.
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
    acceleration = float(np.sum(spread ** 3) / denominator) if denominator > 0 else 0.0
    tail = (1 - LEVEL) / 2
    bounds = []
    for z in (_NORMAL.inv_cdf(tail), _NORMAL.inv_cdf(1 - tail)):
        stretch = 1 - acceleration * (z0 + z)
        if stretch <= 0:  # extreme skew (a >= 1/(z0 + z)): the bound runs to the end of the draws
            bounds.append(100.0 if z > 0 else 0.0)
            continue
        bounds.append(100 * _NORMAL.cdf(z0 + (z0 + z) / stretch))
    low, high = np.percentile(draws, bounds)
    return Interval(_rounded(estimate, digits), _rounded(low, digits), _rounded(high, digits), samples)


# Two-sided 95% quantiles of Student's t with 1..10 degrees of freedom (any table of t).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


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


# ---------------------------------------------------------------- tests over a table's comparisons
FLIPS = 10_000  # random sign flips of a paired permutation test, at least (see flips_for)
EXACT_UP_TO = 16  # non-zero differences up to which every one of the 2^k sign patterns is enumerated
_CHUNK = 4096  # sign patterns evaluated at once (bounds memory on large suites)


def flips_for(family_size: int) -> int:
    """Random flips for a family of ``family_size`` comparisons: enough that the smallest p-value
    a Monte Carlo test can give, 1/(flips + 1), stays below 0.01 after Holm multiplies it by the
    family size. With fewer, a difference no flip matches could still fail the adjustment
    for want of resolution, not of evidence."""
    return max(FLIPS, 100 * family_size)


def sign_flip_p(per_task: dict[str, np.ndarray], flips: int = FLIPS, seed: int = SEED) -> float:
    """Two-sided p-value of a paired difference (the mean over tasks of the per-task mean
    differences) under the null that each sample's difference is as likely negated.

    Only non-zero differences can change sign, so the statistic is sum_i s_i w_i d_i over the k
    non-zero differences d_i (weight w_i = 1 / (tasks x samples of d_i's task), s_i = +-1). When
    k <= ``EXACT_UP_TO`` all 2^k sign patterns are enumerated: p = (patterns at least as extreme)
    / 2^k, the exact permutation p-value. Otherwise ``flips`` random patterns from one generator
    seeded ``seed``: p = (1 + flips at least as extreme) / (1 + flips), valid at any ``flips``.
    All-zero differences give p = 1."""
    tasks = sorted(per_task)
    weighted = []
    for task in tasks:
        values = np.asarray(per_task[task], dtype=float)
        weighted.append(values[values != 0] / (len(values) * len(tasks)))
    weighted = np.concatenate(weighted) if weighted else np.zeros(0)
    observed = abs(weighted.sum())
    if observed == 0:
        return 1.0
    threshold = observed * (1 - 1e-9)  # the observed pattern itself counts despite float rounding
    k = len(weighted)
    if k <= EXACT_UP_TO:
        patterns = np.arange(2 ** k)[:, None] >> np.arange(k) & 1
        extreme = np.sum(np.abs((2 * patterns - 1) @ weighted) >= threshold)
        return float(extreme / 2 ** k)
    rng = np.random.default_rng(seed)
    extreme = 0
    for start in range(0, flips, _CHUNK):
        signs = rng.integers(0, 2, size=(min(_CHUNK, flips - start), k)) * 2 - 1
        extreme += int(np.sum(np.abs(signs @ weighted) >= threshold))
    return float((1 + extreme) / (1 + flips))


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

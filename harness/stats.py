"""How sure a score is: seeded bootstrap intervals over samples, for scores and paired differences.

One resampling scheme serves everything. For each task (in sorted order) the bootstrap draws
``RESAMPLES`` resamples of its samples with replacement from one ``numpy`` generator seeded with
``SEED``; a task's interval is the 2.5th and 97.5th percentiles of its resampled means, and the
average's interval those of the mean over tasks of the resampled means (tasks are resampled
within themselves, as the average weighs them equally). A paired difference (policy A minus
policy B, or minus full cache) resamples the per-sample differences of the same samples, so the
noise shared by both runs (an easy or hard sample) cancels. A difference is significant when its
95% interval excludes zero. All on LongBench's 0-100 scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95


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


def bootstrap(per_task: dict[str, np.ndarray], resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, np.ndarray]:
    """Per task (values in [0, 1], or differences of such), ``resamples`` resampled means x 100."""
    rng = np.random.default_rng(seed)
    means = {}
    for task in sorted(per_task):
        values = np.asarray(per_task[task], dtype=float)
        draws = rng.integers(0, len(values), size=(resamples, len(values)))
        means[task] = 100 * values[draws].mean(axis=1)
    return means


def _interval(estimate: float, draws: np.ndarray, samples: int) -> Interval:
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    return Interval(round(float(estimate), 2), round(float(low), 2), round(float(high), 2), samples)


def intervals(per_task: dict[str, np.ndarray]) -> tuple[dict[str, Interval], Interval]:
    """Each task's interval and the average's (mean of the task scores)."""
    draws = bootstrap(per_task)
    tasks = {task: _interval(100 * np.mean(per_task[task]), draws[task], len(per_task[task])) for task in draws}
    average_draws = np.mean([draws[task] for task in draws], axis=0)
    average = _interval(np.mean([100 * np.mean(per_task[t]) for t in draws]), average_draws,
                        sum(len(v) for v in per_task.values()))
    return tasks, average


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
FLIPS = 10_000  # sign flips of a paired permutation test (smallest p-value 1/10001)


def sign_flip_p(per_task: dict[str, np.ndarray], flips: int = FLIPS, seed: int = SEED) -> float:
    """Two-sided p-value of a paired difference (the mean over tasks of the per-task mean
    differences) under the null that each sample's difference is as likely negated: every sample's
    sign is flipped at random ``flips`` times (one seeded generator, tasks in sorted order);
    p = (1 + flips at least as extreme) / (1 + flips). All-zero differences give p = 1."""
    tasks = sorted(per_task)
    values = [np.asarray(per_task[t], dtype=float) for t in tasks]
    observed = abs(np.mean([v.mean() for v in values]))
    if observed == 0:
        return 1.0
    rng = np.random.default_rng(seed)
    statistic = np.zeros(flips)
    for v in values:
        signs = rng.integers(0, 2, size=(flips, len(v))) * 2 - 1
        statistic += (signs * v).mean(axis=1)
    statistic = np.abs(statistic / len(values))
    return float((1 + np.sum(statistic >= observed - 1e-12)) / (1 + flips))


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


def bca_interval(per_task: dict[str, np.ndarray], resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """A bias-corrected and accelerated (BCa) 95% interval for the mean over tasks of the task
    means (x 100), from the same stratified bootstrap draws as ``intervals``: the percentile
    interval shifted by the draws' median bias (z0) and widened by the skew the jackknife
    measures (acceleration a; Efron 1987). With 20 samples the percentile interval is too
    narrow for skewed 0/1 scores; BCa corrects that to second order."""
    from statistics import NormalDist

    normal = NormalDist()
    tasks = sorted(per_task)
    values = [100 * np.asarray(per_task[t], dtype=float) for t in tasks]
    estimate = float(np.mean([v.mean() for v in values]))
    draws = np.mean(list(bootstrap(per_task, resamples, seed).values()), axis=0)
    samples = sum(len(v) for v in values)
    below = (np.sum(draws < estimate) + 0.5 * np.sum(draws == estimate)) / len(draws)
    if np.all(draws == draws[0]):
        return Interval(round(estimate, 2), round(estimate, 2), round(estimate, 2), samples)
    below = min(max(below, 1 / (len(draws) + 1)), len(draws) / (len(draws) + 1))
    z0 = normal.inv_cdf(below)
    # Jackknife: leave one sample out of its task, recompute the statistic.
    means = [v.mean() for v in values]
    leave_one_out = []
    for index, v in enumerate(values):
        if len(v) < 2:
            continue
        others = sum(means) - means[index]
        leave_one_out.extend((others + (v.sum() - v) / (len(v) - 1)) / len(values))
    leave_one_out = np.asarray(leave_one_out)
    spread = leave_one_out.mean() - leave_one_out
    denominator = 6 * np.sum(spread ** 2) ** 1.5
    acceleration = float(np.sum(spread ** 3) / denominator) if denominator > 0 else 0.0
    tail = (1 - LEVEL) / 2
    bounds = []
    for z in (normal.inv_cdf(tail), normal.inv_cdf(1 - tail)):
        shifted = z0 + (z0 + z) / (1 - acceleration * (z0 + z))
        bounds.append(100 * normal.cdf(shifted))
    low, high = np.percentile(draws, bounds)
    return Interval(round(estimate, 2), round(float(low), 2), round(float(high), 2), samples)


def detectable_difference(per_task: dict[str, np.ndarray], alpha: float = 1 - LEVEL, power: float = 0.8) -> float:
    """The smallest paired difference of the average (0-100) that a two-sided test at ``alpha``
    detects with probability ``power``, from the observed per-task variances of the differences
    (normal approximation: (z_{1-alpha/2} + z_power) x its standard error)."""
    from statistics import NormalDist

    normal = NormalDist()
    tasks = sorted(per_task)
    variance = sum(np.var(100 * np.asarray(per_task[t], dtype=float), ddof=1) / len(per_task[t])
                   for t in tasks if len(per_task[t]) > 1) / len(tasks) ** 2
    return float((normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)) * np.sqrt(variance))

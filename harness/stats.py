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

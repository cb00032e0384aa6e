"""One word per comparison (issue 65, item 1): what its data decide, and only that.

A paired difference (row minus column) with its 95% interval, which inverts its own test, its
Holm-adjusted p over the table's family, and a margin stated in the study's record
(``harness.analysis.studies.Study.margin``) before it runs:

* ``better`` / ``worse``: Holm-adjusted p < 0.05 (and the mark settled), by the sign of the
  difference and which way the quantity is better;
* ``equivalent``: not decided, and the interval lies inside (-margin, +margin): two one-sided
  tests (TOST), each at 2.5%, reject a difference of a margin or more either way;
* ``non-inferior``: not decided, and the interval's bound on the worse side lies inside the
  margin: the one-sided test at 2.5% rejects "worse by the margin or more";
* ``inconclusive``: none of these. Undecided is not level: only ``equivalent`` says two are alike,
  and only ``non-inferior`` that one is no worse than the other by the margin.

A design that cannot decide (``harness.analysis.stats.can_decide``: its smallest attainable p
times the family size is not below 0.05) enters no verdict: ``no verdict``.
"""
from __future__ import annotations

import math

SIGNIFICANCE = 0.05
NO_VERDICT = "no verdict"  # a design that cannot decide, or a ratio measured once (no interval)
VERDICTS = ("better", "worse", "equivalent", "non-inferior", "inconclusive", NO_VERDICT)
# How one comparison decides on two models, each by its own verdict: ``{a}`` and ``{b}`` are the
# models' names. Here, not in harness.analysis.cross_model, because report prints them too
# (RESULTS.md's across-models lines) and cross_model imports report: report cannot import it.
ACROSS_MODELS = ("same direction on both", "opposite ways", "decided on {a} only", "decided on {b} only",
                 "undecided on both")


def verdict(diff: float, low: float, high: float, p_holm: float, margin: float | None, *,
            higher_is_better: bool = True, settled: bool = True, decidable: bool = True) -> str:
    if not decidable:
        return NO_VERDICT
    if settled and p_holm == p_holm and p_holm < SIGNIFICANCE:
        return "better" if (diff > 0) == higher_is_better else "worse"
    if margin is None or not (math.isfinite(low) and math.isfinite(high)):
        return "inconclusive"
    if -margin < low and high < margin:
        return "equivalent"
    if (low > -margin) if higher_is_better else (high < margin):
        return "non-inferior"
    return "inconclusive"


def ratio_verdict(estimate: float, low: float, high: float, margin: float, higher_is_better: bool = True) -> str:
    """The same words for a ratio against a baseline with a 95% interval (throughput over trials):
    better/worse when the interval excludes 1, equivalent inside (1 - margin, 1 / (1 - margin)),
    non-inferior when the worse-side bound is inside it."""
    floor, ceiling = 1 - margin, 1 / (1 - margin)
    if low > 1 or high < 1:
        return "better" if (low > 1) == higher_is_better else "worse"
    if floor < low and high < ceiling:
        return "equivalent"
    if (low > floor) if higher_is_better else (high < ceiling):
        return "non-inferior"
    return "inconclusive"


def ratio_word(interval, higher_is_better: bool = True) -> str:
    """The verdict on a ratio to its reference from its 95% interval (an ``Interval`` of
    ``harness.analysis.stats``): ``ratio_verdict`` at ``THROUGHPUT_MARGIN``, the one function and
    margin of every throughput summary and of RESULTS.md's throughput tables, so that the two never
    give one comparison two words (issue 65: every ratio stated over trials carries a verdict)."""
    from harness.analysis.studies import THROUGHPUT_MARGIN

    return ratio_verdict(interval.estimate, interval.low, interval.high, THROUGHPUT_MARGIN, higher_is_better)


def trials_verdict(ratios: list[float], higher_is_better: bool = True) -> str:
    """The verdict on a ratio measured once per trial (``ratio_word`` of its t-interval over the
    trials, ``harness.analysis.stats.ratio_interval``); one trial has no interval: no verdict."""
    from harness.analysis.stats import ratio_interval

    return ratio_word(ratio_interval(ratios), higher_is_better) if len(ratios) >= 2 else NO_VERDICT

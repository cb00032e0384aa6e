"""Samples that score 0 in every cell ("dead" samples), and the task scores without them.

Why: on a small model many samples score 0 whatever the cache keeps (full cache included): the
model never answers them. They enter every cell's average at 0, so they say nothing about one
policy against another, yet they pull every score toward 0 and make differences look smaller
than they are on the samples where anything happens. A summary that does not say how many there
are leaves a reader unable to tell "policy A loses 3 points" from "policy A loses 3 points of the
40% of the suite that any cell answers" (issue 37, item 3).

Everything here works on one table's runs: one (model, data) group, whose runs share samples,
as ``{run_dir: {task: Series of per-sample scores in [0, 1] indexed by sample id}}`` (what
``harness.analysis.aggregate.group_scores`` reads from the runs' ``predictions.jsonl``).

* ``dead_samples``: the samples (task, id) present in every run that score exactly 0 in every
  run. A sample missing from some run (a cell run with a smaller ``data.limit``, a skipped
  sample) is not counted either way: whether it is dead cannot be known.
* ``live_scores``: each run's task score restricted to the other samples present in every run
  (the live ones: some run scores > 0), as the summaries' statistic (the unweighted mean over
  tasks of the task means, x 100) with its 95% BCa interval (``harness.analysis.stats``). A task
  whose every sample is dead has no live sample and drops out of that mean.
* ``silence_section`` (markdown for ``summary.md``) takes the summary frame's rows of one group,
  as ``aggregate.to_markdown`` iterates them (``report.py`` quotes ``dead_samples``' counts).

What the live table says about the main one. Write n_t for a task's samples, l_t for its live
ones, s_t = l_t / n_t its live share, L_t a cell's mean over the live samples, T the tasks and T'
those with a live sample. A dead sample scores 0 in every cell, so the main table's task score is
s_t x L_t: on one task, a difference between two cells keeps its sign and shrinks by exactly s_t.
The averages are (1/T) sum_t s_t L_t (main) and (1/T') sum_t L_t (live): when every live task has
the same share s, a difference of main averages is s x T'/T times the live one (same sign, shrunk
uniformly); when the shares differ, the main average weighs tasks by their live shares and the
live one equally, so a difference of averages can shrink by more or less than the overall live
share and can even change sign. ``silence_section`` says which case holds and counts the pairs of
cells whose difference changes sign.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pandas as pd

from harness.analysis.labels import markdown_table, with_budget_label, with_interval
from harness.analysis.stats import Interval, bca_interval

SCALE = 100  # per-sample scores in [0, 1], reported on the 0-100 scale (aggregate.SCORE.scale)
DIGITS = 2  # decimals kept (aggregate.SCORE.digits)
DECIMALS = 1  # decimals printed (what aggregate.interval_table prints for the score)
HEADING = "### Samples that score 0 in every cell"

ScoresByRun = dict[str, dict[str, pd.Series]]


@dataclass(frozen=True)
class DeadSamples:
    """One table's dead samples. ``samples``: per task, the ids present in every run (tasks
    missing from some run are left out); ``dead``: per task, those scoring exactly 0 in every
    run; ``left_out``: (task, id) pairs present in some run but not in all, counted nowhere."""
    runs: int
    samples: dict[str, pd.Index]
    dead: dict[str, pd.Index]
    left_out: int

    @property
    def tasks(self) -> list[str]:
        return sorted(self.samples)

    @property
    def total(self) -> int:
        return sum(len(ids) for ids in self.samples.values())

    @property
    def dead_total(self) -> int:
        return sum(len(ids) for ids in self.dead.values())

    @property
    def live_total(self) -> int:
        return self.total - self.dead_total

    def live(self, task: str) -> pd.Index:
        """The task's live sample ids: present in every run, some run scores > 0."""
        return self.samples[task].difference(self.dead[task], sort=False)

    def share(self, task: str) -> float:
        """The task's live share l_t / n_t (0 for a task with no common sample)."""
        return len(self.live(task)) / len(self.samples[task]) if len(self.samples[task]) else 0.0

    @property
    def dead_tasks(self) -> list[str]:
        """Tasks with samples but no live one: they drop out of the live average."""
        return [task for task in self.tasks if len(self.samples[task]) and not len(self.live(task))]

    @property
    def live_tasks(self) -> list[str]:
        return [task for task in self.tasks if len(self.live(task))]

    def per_task_text(self, dead_only: bool = False) -> str:
        """``code_completion 8/20, key_retrieval 1/20, ...`` (dead / present in every run;
        ``dead_only``: the tasks with a dead sample)."""
        return ", ".join(f"{task} {len(self.dead[task])}/{len(self.samples[task])}" for task in self.tasks
                         if len(self.dead[task]) or not dead_only)

    def text(self, full_cache: bool = False) -> str:
        """One sentence: how many samples score 0 in every cell, overall and per task
        (``full_cache``: the cells include full cache, and the sentence says so)."""
        if not self.total:
            return f"No sample is present in all {self.runs} cells: nothing to count."
        cells = "the one cell" if self.runs == 1 else f"all {self.runs} cells"
        counted = "Only samples present in every cell count " + (
            f"({self.left_out} present in some cells but not all are left out)." if self.left_out
            else "(here every sample is).")
        if not self.dead_total:
            return f"No sample scores 0 in {cells} (of {self.total} samples). {counted}"
        return (f"{self.dead_total} of {self.total} samples ({self.dead_total / self.total:.0%}) score 0 in {cells}"
                f"{', full cache included' if full_cache else ''}: {self.per_task_text()}. {counted}")


def dead_samples(scores_by_run: ScoresByRun) -> DeadSamples:
    """The samples of one table (its runs share samples) that score exactly 0 in every run.

    Exactly 0, not "near 0": a partial F1 or code-similarity score of 0.05 is an answer that
    overlaps the reference, and a sample any cell gets partly right can tell cells apart. Only
    samples present in every run count: a sample one run lacks could score in that run."""
    if not scores_by_run:
        raise ValueError("no runs")
    runs = list(scores_by_run.values())
    everywhere = set.intersection(*(set(by_task) for by_task in runs))
    samples, dead, left_out = {}, {}, 0
    for task in sorted(set().union(*runs)):
        present = [by_task[task].index for by_task in runs if task in by_task]
        union = present[0]
        for ids in present[1:]:
            union = union.union(ids, sort=False)
        if task not in everywhere:
            left_out += len(union)
            continue
        common = present[0]
        for ids in present[1:]:
            common = common.intersection(ids, sort=False)
        left_out += len(union) - len(common)
        zero = np.ones(len(common), dtype=bool)
        for by_task in runs:
            zero &= by_task[task].loc[common].to_numpy(dtype=float) == 0
        samples[task], dead[task] = common, common[zero]
    return DeadSamples(len(runs), samples, dead, left_out)


def restrict(scores_by_run: ScoresByRun, ids: dict[str, pd.Index]) -> ScoresByRun:
    """Every run's per-task scores on the given sample ids only (tasks with none dropped)."""
    return {run: {task: by_task[task].loc[ids[task]] for task in sorted(ids) if len(ids[task])}
            for run, by_task in scores_by_run.items()}


def live_samples(scores_by_run: ScoresByRun, dead: DeadSamples | None = None) -> ScoresByRun:
    """The same runs on the live samples only: present in every run, some run scores > 0. A task
    with no live sample is dropped (it would add 0 to every cell's mean and carry nothing)."""
    dead = dead or dead_samples(scores_by_run)
    return restrict(scores_by_run, {task: dead.live(task) for task in dead.tasks})


def live_scores(scores_by_run: ScoresByRun, dead: DeadSamples | None = None, scale: float = SCALE,
                digits: int = DIGITS) -> dict[str, Interval]:
    """Per run, the task score over the live samples: the unweighted mean over the live tasks of
    each task's mean on its live samples (x ``scale``), with its 95% BCa interval
    (``harness.analysis.stats.bca_interval``, the summaries' interval: same resamples and seed).
    Empty when no sample is live."""
    live = live_samples(scores_by_run, dead)
    return {run: bca_interval({task: series.to_numpy(dtype=float) for task, series in by_task.items()},
                              scale=scale, digits=digits)
            for run, by_task in live.items() if by_task}


def mean_over_tasks(by_task: dict[str, pd.Series]) -> float:
    """The summaries' statistic in [0, 1], unrounded: the unweighted mean of the task means."""
    return float(np.mean([series.mean() for series in by_task.values()])) if by_task else float("nan")


def sign_changes(scores_by_run: ScoresByRun, dead: DeadSamples | None = None) -> tuple[int, int]:
    """(pairs of runs, pairs whose difference of averages has opposite signs, both non-zero, in
    the main statistic over every common sample and in the live one). Unrounded values: a sign
    that only rounding changes is not counted."""
    dead = dead or dead_samples(scores_by_run)
    common = restrict(scores_by_run, dead.samples)
    live = live_samples(scores_by_run, dead)
    main = {run: mean_over_tasks(by_task) for run, by_task in common.items()}
    alive = {run: mean_over_tasks(by_task) for run, by_task in live.items()}
    pairs = list(combinations(sorted(scores_by_run), 2))
    changed = sum(1 for a, b in pairs if (main[a] - main[b]) * (alive[a] - alive[b]) < 0)
    return len(pairs), changed


# ---------------------------------------------------------------- from the summary frame of one group
def cells(group: pd.DataFrame) -> pd.DataFrame:
    """One row per run of the group, indexed by ``run_dir``, with ``variant`` and ``budget`` as
    table labels (``labels.budget_label``: "256", "r0.5", "all"). Accepts the summary frame as
    ``aggregate`` builds it (one row per run and task, raw budgets) or already labelled."""
    runs = group.drop_duplicates("run_dir")
    if not runs["budget"].map(lambda budget: isinstance(budget, str)).all():
        runs = with_budget_label(runs)
    return runs.set_index("run_dir")[["variant", "budget"]]


def _budget_order(budget: str) -> tuple:
    """Columns as ``labels.in_reading_order`` orders budgets: "all", then tokens, then ratios."""
    if budget.isdigit():
        return (False, int(budget), budget)
    if budget.startswith("r"):
        try:
            return (True, float(budget[1:]), budget)
        except ValueError:
            pass
    return (False, -1.0, budget)


def live_table(labels: pd.DataFrame, intervals: dict[str, Interval], decimals: int = DECIMALS) -> pd.DataFrame:
    """Rows the variants (full cache first, then by name), columns the budget labels ("all",
    then tokens ascending, then ratios ascending), cells ``mean (low, high)`` as
    ``aggregate.interval_table`` writes them; empty where no run has that variant and budget."""
    table: dict[str, dict[str, str]] = {}
    for run, interval in intervals.items():
        variant, budget = labels.loc[run, "variant"], labels.loc[run, "budget"]
        row = table.setdefault(variant, {})
        if budget in row:
            raise ValueError(f"two runs are {variant} at budget {budget}: one cell of the table each")
        row[budget] = with_interval(interval.estimate, interval.low, interval.high, decimals)
    budgets = sorted({budget for row in table.values() for budget in row}, key=_budget_order)
    variants = sorted(table, key=lambda variant: (variant != "full", variant))
    frame = pd.DataFrame([[table[v].get(b, "") for b in budgets] for v in variants], index=variants, columns=budgets)
    frame.index.name = "policy"
    return frame


def _percent(share: float) -> str:
    return f"{100 * share:.0f}%"


def relation_text(dead: DeadSamples, pairs: int, changed: int) -> str:
    """How the main table's differences relate to this table's (see the module's docstring)."""
    live_tasks = dead.live_tasks
    per_task = ("The main table counts the dead samples too, at 0 in every cell: on each task a cell's score there is "
                "its mean over the task's live samples times the task's live share, so a difference between two "
                "cells on one task keeps its sign and shrinks by that share.")
    shares = {task: dead.share(task) for task in live_tasks}
    if len(set(shares.values())) <= 1:
        share = next(iter(shares.values()))
        factor = share * len(live_tasks) / len(dead.tasks)
        why = (f"the live share {_percent(share)}" if len(live_tasks) == len(dead.tasks) else
               f"the live tasks' share {_percent(share)} times {len(live_tasks)}/{len(dead.tasks)}, the dead tasks "
               f"counting 0")
        return (f"{per_task} Every live task has the same live share, so a difference of averages in the main table is "
                f"this table's times {factor:.2f} ({why}): same sign, shrunk uniformly.")
    listed = ", ".join(f"{task} {_percent(share)}" for task, share in shares.items())
    fewest = min(live_tasks, key=lambda task: (len(dead.live(task)), task))
    weight = (f" Each live task weighs 1/{len(live_tasks)} here however few live samples it has (fewest: {fewest}, "
              f"{len(dead.live(fewest))}), so such a task's mean is the noisiest part of this average.")
    verb = "has" if changed == 1 else "have"
    flips = (f"Of the {pairs} pairs of cells, {changed} {verb} a difference of averages of opposite sign in the two "
             f"tables." if pairs else "")
    return (f"{per_task} The averages weigh tasks differently: the main one weighs each task's difference by its live "
            f"share ({listed}){' and counts the dead tasks at 0' if dead.dead_tasks else ''}, this one weighs the "
            f"live tasks equally. With unequal shares a difference of averages does not shrink uniformly: it can "
            f"shrink by more or less than the overall live share ({_percent(dead.live_total / dead.total)}) and can "
            f"change sign. {flips}{weight}").rstrip()


def silence_section(group: pd.DataFrame, scores_by_run: ScoresByRun) -> list[str]:
    """Markdown lines for one (model, data) group of ``summary.md``: a heading, the dead-sample
    counts overall and per task, and, when some samples are dead and some live, the task score
    of every cell over the live samples (rows variant, columns budget label) with what it means
    for the main table. ``group``: the summary frame's rows of the group (``run_dir``,
    ``variant``, ``budget``, ``budget_ratio`` as ``aggregate`` builds them); ``scores_by_run``:
    the runs' per-sample scores (``harness.analysis.aggregate.group_scores``)."""
    dead = dead_samples(scores_by_run)
    full_cache = "policy.name" in group and bool((group["policy.name"] == "full").any())
    lines = [HEADING, "", dead.text(full_cache), ""]
    if not dead.dead_total:
        return lines
    if not dead.live_total:
        return lines + ["No sample scores in any cell: no table over live samples.", ""]
    intervals = live_scores(scores_by_run, dead)
    pairs, changed = sign_changes(scores_by_run, dead)
    dropped = ""
    if dead.dead_tasks:
        names = ", ".join(dead.dead_tasks)
        dropped = (f" {names} {'has' if len(dead.dead_tasks) == 1 else 'have'} no live sample and "
                   f"{'drops' if len(dead.dead_tasks) == 1 else 'drop'} out: the mean is over the other "
                   f"{len(dead.live_tasks)} task(s).")
    return lines + [
        f"Task score (0-100) of every cell over the {dead.live_total} live samples (those some cell scores above 0; "
        f"{_percent(dead.live_total / dead.total)} of the {dead.total}): the unweighted mean over tasks of each task's "
        f"mean on its live samples, with 95% BCa intervals computed as the score table's above.{dropped} Rows are policies, columns budgets.",
        "",
        markdown_table(live_table(cells(group), intervals)),
        "",
        relation_text(dead, pairs, changed),
        "",
    ]

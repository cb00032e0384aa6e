"""Run directories -> one pandas DataFrame -> ``summary.csv`` and ``summary.md`` (+ plots).

    python -m harness.analysis.aggregate results/runs [more dirs] --out results/summary

One row per (run, task), every config key as a column (``policy.name``, ``budget``, ``model.name``,
...), with the task score, the run's average, fidelity to full cache, throughput, latency and KV
memory. Retention is a policy's score as a percentage of the full-cache score of the same model,
data and task; throughput ratios are against the same model and data's full-cache run.

Every score carries its 95% BCa bootstrap interval (``score_low``/``score_high``, ``average_low``/
``average_high``, from the per-sample scores in ``predictions.jsonl``; ``harness.analysis.stats``) and
the Monte Carlo error of its bounds (``score_mc``, ``average_mc``), and every run its paired
differences, sample by sample, against full cache and against each other policy at the same budget:
``vs_<policy>_diff``/``_low``/``_high``/``_mc`` per task and ``avg_vs_<policy>_diff``/``_low``/
``_high``/``_mc`` for the average (this run minus that one; the interval inverts the comparison's
own sign-flip test, ``stats.inverted_interval``, so it excludes zero exactly when p < 0.05), each
with its paired sign-flip p-value
``_p`` (with ``_p_mc``, its Monte Carlo standard error, ``_p_flips``, the random sign patterns
behind it, 0 when exact, and ``_p_settled``) and that p adjusted over the table's family of
comparisons, ``_p_holm`` (what ``summary.md`` marks ``*``) and ``_p_bh`` (flagged ``+``);
``add_intervals`` says why both. Any per-sample field of the prediction rows is compared the same
way when every run of a (model, data) group records it (``Quantity``, ``QUANTITIES``), under its
own prefix (``answer_logprob_avg_vs_<policy>_p``) and in its own tables.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from harness.records.results import RUN_FILES, atomic_write_text, is_complete, read_json, read_jsonl
from harness.analysis.silence import silence_section
from harness.analysis.studies import DEFAULT_MARGIN, margin_for
from harness.analysis.labels import (ROW, budget_label, in_reading_order, markdown_table, signed, variant_label,
                                     with_budget_label, with_interval)
from harness.analysis.stats import (EXACT_OUTCOMES, EXACT_UP_TO, FLIPS, MAX_FLIPS, MAX_RESAMPLES, RESAMPLES, SECTIONS,
                                    WIDTH, _units, benjamini_hochberg, can_decide, cell_interval,
                                    detectable_difference, holm, inverted_interval, mc_target, settled_p_values,
                                    smallest_p)
from harness.analysis.verdicts import verdict

RUN_KEYS = ["model.name", "data.name", "policy.name", "budget", "block_size"]


def find_runs(roots: list[Path]) -> list[Path]:
    """Every complete run directory under ``roots``. A cell found under several roots (the same
    model, data and cell name: the same identity, such as the full cache two studies share) is
    one cell, read from the first root that has it."""
    found: dict[tuple[str, ...], Path] = {}
    for root in roots:
        for config in sorted(root.rglob(RUN_FILES[0])):
            run = config.parent
            if is_complete(run) and not run.name.endswith(".partial"):
                found.setdefault(run.parts[-3:], run)
    return sorted(found.values())


def flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif not isinstance(value, list):
            flat[name] = value
    return flat


def run_rows(run_dir: Path, drop_tasks: tuple[str, ...] = ()) -> list[dict]:
    """One row per task of a run (``drop_tasks`` left out: the average is then the mean of the
    other tasks' scores, as ``scores.json`` would give it without them)."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config.pop("provenance", None)
    scores, perf = read_json(run_dir / "scores.json"), read_json(run_dir / "perf.json")
    base = flatten(config)
    base["variant"] = variant_label(config)
    if base.get("policy.name") == "full":
        base["budget"] = None  # full cache keeps everything, whatever the configured budget
        base["budget_ratio"] = None
    fidelity = scores.get("fidelity") or {}
    kv = perf.get("kv") or {}
    base.update({
        "run_dir": str(run_dir),
        "average": scores.get("average"),
        "fidelity_exact_match": fidelity.get("exact_match"),
        "fidelity_rougeL": fidelity.get("rougeL_f"),
        "isolated": perf.get("isolated", True),
        "output_tokens_per_s": perf.get("output_tokens_per_s"),
        "total_tokens_per_s": perf.get("total_tokens_per_s"),
        "ttft_p50_s": (perf.get("ttft_s") or {}).get("p50"),
        "tpot_p50_s": (perf.get("tpot_s") or {}).get("p50"),
        "latency_p50_s": (perf.get("latency_s") or {}).get("p50"),
        "kv_blocks_peak": kv.get("kv_blocks_used_peak"),
        "kv_blocks_mean": kv.get("kv_blocks_used_mean"),
        "running_peak": kv.get("running_requests_peak"),
        "evict_share": kv.get("evict_share_of_step"),
        "preemptions": perf.get("preemptions"),
    })
    kept = {task: entry for task, entry in scores["tasks"].items() if task not in drop_tasks}
    if len(kept) < len(scores["tasks"]):
        base["average"] = round(float(np.mean([entry["score"] for entry in kept.values()])), 2)
    rows = []
    for task, entry in kept.items():
        row = dict(base, task=task, metric=entry["metric"], samples=entry["samples"], score=entry["score"])
        row["task_fidelity_rougeL"] = (fidelity.get("tasks") or {}).get(task, {}).get("rougeL_f")
        rows.append(row)
    return rows


def load_runs(roots: list[Path], drop_tasks: tuple[str, ...] = ()) -> pd.DataFrame:
    """Every complete run under ``roots``, one row per task, with its intervals and comparisons;
    ``drop_tasks``: tasks left out of every table (their samples too)."""
    rows = [row for run in find_runs(roots) for row in run_rows(run, drop_tasks)]
    if not rows:
        raise FileNotFoundError(f"no complete run directory under {', '.join(map(str, roots))}")
    frame = pd.DataFrame(rows)
    return add_intervals(add_relative_columns(frame))


@dataclass(frozen=True)
class Quantity:
    """A per-sample field of ``predictions.jsonl`` that tables compare, and how to read it.

    ``scale`` multiplies per-sample values into the reported units (100 puts a score in [0, 1] on
    the 0-100 scale; 1 keeps a log-likelihood as it is). Every statistic is the one the score
    uses: the unweighted mean over tasks of the task means, its BCa interval, paired differences
    sample by sample with their sign-flip p-values."""
    field: str
    scale: float
    description: str
    units: str  # what a reported number is, in a table's text
    unit: str  # after a number: "8.3 points"
    higher_is_better: bool = True
    decimals: int = 2  # printed
    digits: int = 4  # decimals kept in summary.csv (more than printed)
    bounds: tuple[float, float] = (-math.inf, math.inf)  # every per-sample value's range, before scale

    @property
    def difference_bounds(self) -> tuple[float, float]:
        """Where a paired difference of two values lies: within the values' width either way."""
        width = self.bounds[1] - self.bounds[0]
        return (-width, width)

    @property
    def mc_target(self) -> float:
        """The largest Monte Carlo error a bound may carry (``harness.analysis.stats.mc_target``): 0.1
        on the 0-100 scale, 0.01 in a quantity's own units (nats)."""
        return mc_target(self.scale)

    @property
    def _prefix(self) -> str:
        return "" if self.field == "score" else f"{self.field}_"  # the score keeps its historical names

    @property
    def task_column(self) -> str:
        """Per (run, task): the task's mean (for the score, the one ``scores.json`` records)."""
        return self.field

    @property
    def average_column(self) -> str:
        return "average" if self.field == "score" else f"{self.field}_average"

    def versus(self, variant: str, average: bool) -> str:
        """Column stem of a paired difference against ``variant``: ``avg_vs_paged`` (average) or
        ``vs_paged`` (per task); other quantities are prefixed, ``answer_logprob_avg_vs_paged``."""
        return f"{self._prefix}{'avg_' if average else ''}vs_{variant}"


SCORE = Quantity("score", 100, "score", "points on the 0-100 scale", "points", digits=2, bounds=(0.0, 1.0))
# Per-sample fields being added to prediction rows (issue 25, item 1), with the definitions
# announced for them: the reference answer's mean log-probability per token (natural log), the
# share in [0, 1] of full cache's output steps whose top-1 token this cell's cache also ranks
# first, and the mean KL divergence to full cache per step. Compared only in a group whose every
# run records them, so summaries of runs without them are unchanged.
QUANTITIES = (
    SCORE,
    Quantity("answer_logprob", 1, "reference-answer log-likelihood per token",
             "mean natural-log probability per answer token", "nats/token", decimals=3, bounds=(-math.inf, 0.0)),
    Quantity("top1_agreement", 100, "top-1 agreement with full cache",
             "% of full cache's output steps", "percentage points", bounds=(0.0, 1.0)),
    Quantity("kl_to_full", 1, "KL divergence to full cache",
             "mean nats per step of full cache's output", "nats", higher_is_better=False, decimals=3,
             bounds=(0.0, math.inf)),
)
SIGNIFICANCE = 0.05  # the level adjusted p-values are held to
POWER = 0.8  # of the detectable difference printed under each differences table


def sample_values(predictions: pd.DataFrame, field: str) -> dict[str, pd.Series] | None:
    """Per task, each sample's ``field`` indexed by sample id, samples without a value left out
    (full cache's output can be empty, leaving nothing to agree with); None when the run records
    the field for no sample at all."""
    if field not in predictions or predictions[field].isna().all():
        return None
    known = predictions[predictions[field].notna()]
    return {task: group.set_index("id")[field].astype(float) for task, group in known.groupby("task")}


def sample_scores(run_dir: str) -> dict[str, pd.Series]:
    """Per task, each sample's score in [0, 1] indexed by sample id (``predictions.jsonl``)."""
    return sample_values(pd.DataFrame(read_jsonl(Path(run_dir) / "predictions.jsonl")), "score")


def group_scores(group: pd.DataFrame, root: Path = Path()) -> dict[str, dict[str, pd.Series]]:
    """Per run of a table's group (keyed by its ``run_dir``), its per-sample scores, on the tasks
    the group's rows keep (a summary that left tasks out counts without them). ``root``: what a
    relative ``run_dir`` is under (a committed summary.csv's are relative to the repository)."""
    tasks = set(group["task"])
    scores = {}
    for run in group["run_dir"].unique():
        by_task = sample_scores(str(root / run))
        if by_task is None:
            raise ValueError(f"{run}/predictions.jsonl: no sample has a score")
        scores[run] = {task: series for task, series in by_task.items() if task in tasks}
    return scores


def of_tasks(predictions: pd.DataFrame, tasks: set[str]) -> pd.DataFrame:
    """The prediction rows whose task is one of ``tasks``."""
    return predictions[predictions["task"].isin(tasks)]


def paired(run: dict[str, pd.Series], other: dict[str, pd.Series]) -> dict[str, np.ndarray]:
    """Per task, this run's minus the other's value on the samples both have."""
    return {task: d.to_numpy() for task, d in paired_series(run, other).items()}


def paired_series(run: dict[str, pd.Series], other: dict[str, pd.Series]) -> dict[str, pd.Series]:
    """``paired``, each task's differences kept as a Series indexed by sample id."""
    differences = {}
    for task in sorted(set(run) & set(other)):
        common = run[task].index.intersection(other[task].index)
        if len(common):
            differences[task] = run[task][common] - other[task][common]
    return differences


CLUSTER = "cluster"  # a prediction row's field naming the context, conversation or document it shares


def sample_clusters(predictions: pd.DataFrame) -> dict[str, pd.Series] | None:
    """Per task, each sample's cluster label (``CLUSTER``) indexed by sample id; None when the run's
    samples carry none (each sample then independent). Samples that share a cluster are resampled
    and sign-flipped together (``harness.analysis.stats._units``)."""
    if CLUSTER not in predictions or predictions[CLUSTER].isna().all():
        return None
    if predictions[CLUSTER].isna().any():
        raise ValueError("some samples have a cluster and some not: give every sample one")
    return {task: group.set_index("id")[CLUSTER].astype(str) for task, group in predictions.groupby("task")}


def labels_of(clusters: dict[str, pd.Series] | None, by_task: dict[str, pd.Series]) -> dict[str, np.ndarray] | None:
    """The cluster labels of ``by_task``'s samples, aligned with them (None without clusters)."""
    if clusters is None:
        return None
    return {task: clusters[task][series.index].to_numpy() for task, series in by_task.items()}


def comparable_pairs(runs: pd.DataFrame) -> list[tuple[str, str]]:
    """The distinct comparisons of one (model, data) group's differences table, as (run, other)
    run directories: every evicting run against full cache, and every two variants at the same
    budget label. A table shows a pair of policies twice (A minus B in A's row, B minus A in B's);
    it is one comparison and is listed once."""
    pairs = []
    directories = sorted(runs.index)
    for i, run in enumerate(directories):
        for other in directories[i + 1:]:
            a, b = runs.loc[run], runs.loc[other]
            if a["variant"] == b["variant"] or (a["policy.name"] == "full" and b["policy.name"] == "full"):
                continue
            if a["policy.name"] == "full":
                pairs.append((other, run))  # the evicting run first: differences read "minus full"
            elif b["policy.name"] == "full" or budget_label(a) == budget_label(b):
                pairs.append((run, other))
    return pairs


def add_intervals(frame: pd.DataFrame, quantities: tuple[Quantity, ...] = QUANTITIES) -> pd.DataFrame:
    """Interval, p-value and adjusted p-value columns for every compared quantity (``Quantity``).

    Per run and task ``<task column>_low``/``_high``/``_mc`` and per run ``<average column>``/``_low``/
    ``_high``/``_mc``: 95% BCa intervals (``harness.analysis.stats.bca_interval``; the percentile
    interval is too narrow at 20 samples per task) and the Monte Carlo standard error of their
    bounds (the larger of the two; below ``Quantity.mc_target`` unless the resamples reached
    their cap). Per comparison (``comparable_pairs``), in both runs' rows (the second with the
    sign reversed), per task ``vs_<variant>_…`` and for the average ``avg_vs_<variant>_…``:
    ``_diff`` (this run minus that one), ``_low``/``_high``/``_mc`` (the shifts its own test does
not reject, ``harness.analysis.stats.inverted_interval``: excludes zero exactly when ``_p`` < 0.05), ``_p`` (two-sided
    paired sign-flip test, settled over the family: ``harness.analysis.stats.settled_p_values``),
    ``_p_mc`` (its Monte Carlo standard error, 0 when exact), ``_p_flips`` (random sign patterns,
    0 when exact), ``_p_settled`` (False where a mark could still change within 4 standard errors
    at the most flips), ``_p_holm`` and ``_p_bh`` (adjusted over the family), and for the average
    ``_detectable`` (the difference found with 80% power at Holm's strictest level,
    ``SIGNIFICANCE`` / family size).

    The family is one table's comparisons: for the average, every distinct comparison of one
    (model, data) group; per task, the same comparisons on that task. Both adjustments are
    given; tables mark by Holm and flag BH. Holm is the one claims rest on: it bounds the chance
    of any false finding among a table's comparisons under any dependence between them, and
    these comparisons are strongly dependent (each run enters one per policy at its budget). BH bounds only the
    expected share of false findings, and only under positive dependence; it says where to look
    next, not what is established.

    A quantity other than the score gets columns only in a group whose every run records it
    (``<field>_samples`` counts the samples that have a value; the others are left out of that
    run's statistics and its pairs), so results without it are unchanged."""
    tasks = set(frame["task"])  # the tasks the rows keep (``load_runs``' drop_tasks left out)
    predictions = {run: of_tasks(pd.DataFrame(read_jsonl(Path(run) / "predictions.jsonl")), tasks)
                   for run in frame["run_dir"].unique()}
    runs = frame.drop_duplicates("run_dir").set_index("run_dir")
    columns: dict[tuple[str, str], dict[str, float]] = {}  # (run_dir, task or "") -> values

    def cell(run: str, task: str) -> dict:
        return columns.setdefault((run, task), {})

    for quantity in quantities:
        for _, group in runs.groupby(["model.name", "data.name"]):
            if quantity is SCORE:
                for run in group.index:
                    if "score" not in predictions[run] or predictions[run]["score"].isna().any():
                        raise ValueError(f"{run}/predictions.jsonl: a sample without a score; rerun the cell")
            values = {run: sample_values(predictions[run], quantity.field) for run in group.index}
            if any(v is None for v in values.values()):
                continue  # a run without the field: no table of it for this group
            clusters = {run: sample_clusters(predictions[run]) for run in group.index}
            if quantity is not SCORE:
                for run, by_task in values.items():
                    cell(run, "")[f"{quantity.field}_samples"] = sum(len(series) for series in by_task.values())
            for run, by_task in values.items():
                labels = labels_of(clusters[run], by_task)
                for task, series in by_task.items():
                    interval = cell_interval({task: series.to_numpy()}, scale=quantity.scale, digits=quantity.digits,
                                             target=quantity.mc_target, bounds=quantity.bounds,
                                             clusters=None if labels is None else {task: labels[task]})
                    if quantity is not SCORE:  # the score's own per-task column comes from scores.json
                        cell(run, task)[quantity.task_column] = interval.estimate
                    cell(run, task).update({f"{quantity.task_column}_low": interval.low,
                                            f"{quantity.task_column}_high": interval.high,
                                            f"{quantity.task_column}_mc": interval.mc_error})
                average = cell_interval({t: s.to_numpy() for t, s in by_task.items()}, scale=quantity.scale,
                                        digits=quantity.digits, target=quantity.mc_target, clusters=labels,
                                        bounds=quantity.bounds)
                if quantity is not SCORE:  # the score's average comes from scores.json
                    cell(run, "")[quantity.average_column] = average.estimate
                cell(run, "").update({f"{quantity.average_column}_low": average.low,
                                      f"{quantity.average_column}_high": average.high,
                                      f"{quantity.average_column}_mc": average.mc_error})
            compare(group, values, quantity, cell, clusters)
    per_task = pd.DataFrame([dict(run_dir=r, task=t, **v) for (r, t), v in columns.items() if t])
    per_run = pd.DataFrame([dict(run_dir=r, **v) for (r, t), v in columns.items() if not t])
    return frame.merge(per_task, on=["run_dir", "task"], how="left").merge(per_run, on="run_dir", how="left")


def compare(group: pd.DataFrame, values: dict[str, dict[str, pd.Series]], quantity: Quantity, cell,
            clusters: dict[str, dict[str, pd.Series] | None] | None = None) -> None:
    """Every comparison of one group for one quantity: p-values settled over their family (the
    average's, and each task's: ``settled_p_values`` refines a random p-value until no mark of the
    family could change within its Monte Carlo error), both adjustments over the family, and the
    interval that inverts each comparison's own test (``inverted_interval``: it excludes zero
    exactly when the p-value is below 0.05), written into both runs' cells. ``clusters``: per run,
    its samples' cluster labels (``sample_clusters``), under which tests flip whole clusters."""
    clusters = clusters or {}
    pairs = []
    for run, other in comparable_pairs(group):
        differences = paired_series(values[run], values[other])
        if differences:
            labels = labels_of(clusters.get(run), differences)
            pairs.append((run, other, {t: d.to_numpy() for t, d in differences.items()}, labels))
    families: dict[str, list] = {}  # "" (the average) or a task -> [(run, other, differences, labels)]
    for run, other, differences, labels in pairs:
        families.setdefault("", []).append((run, other, differences, labels))
        for task, d in differences.items():
            families.setdefault(task, []).append((run, other, {task: d}, None if labels is None else {task: labels[task]}))
    for task, family in families.items():
        p_values = settled_p_values([differences for _, _, differences, _ in family], SIGNIFICANCE,
                                    clusters=[labels for *_, labels in family])
        plain = [value.p for value in p_values]
        for (run, other, differences, labels), value, p_holm, p_bh in zip(family, p_values, holm(plain),
                                                                           benjamini_hochberg(plain)):
            interval = inverted_interval(differences, value, scale=quantity.scale, digits=quantity.digits,
                                         target=quantity.mc_target, clusters=labels,
                                         bounds=quantity.difference_bounds)
            units = len(_units(differences, labels)[0])  # samples, or clusters: what the smallest p depends on
            detectable = (None if task else
                          detectable_difference(differences, SIGNIFICANCE / len(pairs), POWER, quantity.scale))
            for this, that, shown in ((run, other, interval), (other, run, interval.negated())):
                if group.loc[this, "policy.name"] == "full":
                    continue  # tables show evicting runs against full cache, never the reverse
                stem = quantity.versus(group.loc[that, "variant"], average=not task)
                cell(this, task).update({
                    f"{stem}_diff": shown.estimate, f"{stem}_low": shown.low, f"{stem}_high": shown.high,
                    f"{stem}_mc": shown.mc_error, f"{stem}_p": value.p, f"{stem}_p_mc": value.se,
                    f"{stem}_p_flips": value.flips, f"{stem}_p_settled": value.settled,
                    f"{stem}_p_holm": p_holm, f"{stem}_p_bh": p_bh, f"{stem}_units": units})
                if detectable is not None:
                    cell(this, task)[f"{stem}_detectable"] = round(detectable, 4)


def add_relative_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Retention (score vs full cache) and throughput ratio, per model, data and task; retention of the
    run's average score per model and data."""
    group = ["model.name", "data.name", "task"]
    full = frame[frame["policy.name"] == "full"].set_index(group)
    full_score = full["score"][~full.index.duplicated()]
    full_speed = full["output_tokens_per_s"][~full.index.duplicated()]
    keys = pd.MultiIndex.from_frame(frame[group])
    reference_score = full_score.reindex(keys).to_numpy()
    reference_speed = full_speed.reindex(keys).to_numpy()
    frame["retention_pct"] = (100 * frame["score"] / reference_score).round(1)
    frame.loc[reference_score == 0, "retention_pct"] = None
    frame["throughput_vs_full"] = (frame["output_tokens_per_s"] / reference_speed).round(2)
    # The same for the run's average score, per model and data (full cache's average is one number).
    runs = full.reset_index().drop_duplicates(["model.name", "data.name"]).set_index(["model.name", "data.name"])
    reference_average = runs["average"].reindex(pd.MultiIndex.from_frame(frame[["model.name", "data.name"]])).to_numpy()
    frame["retention_avg_pct"] = (100 * frame["average"] / reference_average).round(1)
    frame.loc[reference_average == 0, "retention_avg_pct"] = None
    return frame


def score_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Task scores: rows policy x budget, one column per task, then the average."""
    frame = with_budget_label(frame)
    table = frame.pivot_table(index=ROW, columns="task", values="score")
    table["average"] = frame.groupby(ROW)["average"].first()
    return in_reading_order(table.round(2))


def system_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per run: what the policy kept (retention of the average score, fidelity) and what it bought."""
    columns = ["retention_avg_pct", "fidelity_exact_match", "fidelity_rougeL", "output_tokens_per_s",
               "throughput_vs_full", "tpot_p50_s", "kv_blocks_peak", "kv_blocks_mean", "evict_share"]
    runs = with_budget_label(frame.drop_duplicates("run_dir"))
    return in_reading_order(runs.set_index(ROW)[columns].round(3))


def interval_table(frame: pd.DataFrame, quantity: Quantity = SCORE) -> pd.DataFrame:
    """Per-task values and the average with their 95% intervals, as text: ``value (low, high)``."""
    labelled = with_budget_label(frame)
    decimals = 1 if quantity.decimals <= 2 else quantity.decimals
    column, average = quantity.task_column, quantity.average_column
    cells = {}
    for (policy, budget), group in labelled.groupby(ROW):
        row = {task: with_interval(r[column], r[f"{column}_low"], r[f"{column}_high"], decimals)
               for task, r in group.set_index("task").iterrows()}
        first = group.iloc[0]
        row["average"] = with_interval(first[average], first[f"{average}_low"], first[f"{average}_high"], decimals)
        cells[(policy, budget)] = row
    table = pd.DataFrame.from_dict(cells, orient="index")
    table.index.names = ROW
    return in_reading_order(table[sorted(c for c in table.columns if c != "average") + ["average"]])


COMPARISON_PARTS = ("diff", "low", "high", "mc", "p", "p_mc", "p_flips", "p_settled", "p_holm", "p_bh", "detectable",
                    "units")


def table_comparisons(frame: pd.DataFrame, quantity: Quantity = SCORE) -> pd.DataFrame:
    """The distinct comparisons one differences table shows (its family), one row each: ``row`` and
    ``column`` (variant, budget label), ``diff``/``low``/``high``, ``mc`` (the bounds' Monte Carlo
    error), ``p``, ``p_mc``, ``p_flips``, ``p_settled``, ``p_holm``, ``p_bh``, ``detectable``. A
    pair of policies shows twice in the table and once here."""
    runs = with_budget_label(frame.drop_duplicates("run_dir"))
    runs = runs[runs["policy.name"] != "full"]
    found = {}
    for _, run in runs.iterrows():
        for other in ["full"] + sorted(runs["variant"].unique()):
            stem = quantity.versus(other, average=True)
            if f"{stem}_p" not in run or run[f"{stem}_p"] != run[f"{stem}_p"]:
                continue
            here, there = (run["variant"], run["budget"]), (other, "all" if other == "full" else run["budget"])
            key = frozenset([here, there])
            if key not in found:
                found[key] = {"row": here, "column": there,
                              **{part: run.get(f"{stem}_{part}", np.nan) for part in COMPARISON_PARTS}}
    return pd.DataFrame(found.values(), columns=["row", "column", *COMPARISON_PARTS])


def significance_mark(p_holm: float, p_bh: float, settled: bool = True) -> str:
    """``*`` Holm-adjusted p < 0.05; ``+`` Benjamini-Hochberg q < 0.05 but not Holm; ``?`` a
    comparison whose mark 10^7 random sign patterns could not settle (its adjusted p within 4
    Monte Carlo standard errors of 0.05: a recomputation may mark it either way, so it is given
    no mark and counted as undecided); else nothing."""
    if not settled:
        return " ?"
    return " *" if p_holm < SIGNIFICANCE else " +" if p_bh < SIGNIFICANCE else ""


def settled(run, stem: str) -> bool:
    """Whether a comparison's mark is settled (``_p_settled``; results summarised before it existed
    count as settled)."""
    value = run.get(f"{stem}_p_settled", True)
    return True if value != value else bool(value)


def p_text(p: float, digits: int = 3) -> str:
    """``p=0.0123``, ``p=0.000164``: ``digits`` significant digits (``p_digits``)."""
    return f"p={p:.{digits}g}"


def p_digits(family: pd.DataFrame) -> int:
    """Significant digits a table prints its p-values with: the fewest, from 3, from which its marks
    follow (Holm and Benjamini-Hochberg over the printed p-values mark what the unrounded ones
    mark), so that a reader can redo every mark from the table. ``summary.csv`` has them unrounded."""
    marks = [significance_mark(h, b) for h, b in zip(family["p_holm"], family["p_bh"])]
    for digits in range(3, 17):
        printed = [float(f"{p:.{digits}g}") for p in family["p"]]
        if [significance_mark(h, b) for h, b in zip(holm(printed), benjamini_hochberg(printed))] == marks:
            return digits
    return 17


def family_decides(family: pd.DataFrame) -> bool:
    """Whether Holm over the family can reject anything at all (``stats.can_decide``), from each
    comparison's units (samples or clusters); a summary made before units were recorded counts
    as able to decide."""
    if "units" not in family or family["units"].isna().any():
        return True
    return can_decide([int(u) for u in family["units"]], SIGNIFICANCE)


def comparison_verdict(run, stem: str, quantity: Quantity, margin: float | None, decidable: bool = True) -> str:
    """``harness.analysis.verdicts.verdict`` of one comparison's columns; the margin applies to the
    primary signal, the score (other quantities get no margin: better, worse or inconclusive)."""
    return verdict(run[f"{stem}_diff"], run[f"{stem}_low"], run[f"{stem}_high"], run[f"{stem}_p_holm"],
                   margin if quantity is SCORE else None, higher_is_better=quantity.higher_is_better,
                   settled=settled(run, stem), decidable=decidable)


def differences_table(frame: pd.DataFrame, quantity: Quantity = SCORE, margin: float | None = None) -> pd.DataFrame:
    """Paired differences of the average, row policy minus column policy (full cache, then the
    other policies at the same budget): ``diff (low, high) p`` with the 95% interval that inverts the test and the
    unadjusted sign-flip p-value, marked after adjustment over the table (``significance_mark``), and
    its verdict (``comparison_verdict``) at ``margin``."""
    runs = with_budget_label(frame.drop_duplicates("run_dir"))
    runs = runs[runs["policy.name"] != "full"]
    others = ["full"] + sorted(runs["variant"].unique())
    decimals = quantity.decimals
    family = table_comparisons(frame, quantity)
    digits = p_digits(family) if len(family) else 3
    decidable = family_decides(family) if len(family) else True
    cells = {}
    for _, run in runs.iterrows():
        row = {}
        for other in others:
            stem = quantity.versus(other, average=True)
            if f"{stem}_diff" in run and run[f"{stem}_diff"] == run[f"{stem}_diff"]:
                diff, low, high = (signed(run[f"{stem}_{part}"], decimals) for part in ("diff", "low", "high"))
                mark = significance_mark(run[f"{stem}_p_holm"], run[f"{stem}_p_bh"], settled(run, stem))
                word = comparison_verdict(run, stem, quantity, margin, decidable)
                row[f"minus {other}"] = f"{diff} ({low}, {high}) {p_text(run[f'{stem}_p'], digits)}{mark} {word}"
            else:
                row[f"minus {other}"] = ""
        cells[(run["variant"], run["budget"])] = row
    table = pd.DataFrame.from_dict(cells, orient="index")
    table.index.names = ROW
    return in_reading_order(table)


def family_note(frame: pd.DataFrame, quantity: Quantity = SCORE) -> str:
    """What a differences table's marks mean, how many comparisons pass each bar, and the smallest
    difference its sample size detects."""
    from statistics import NormalDist

    family = table_comparisons(frame, quantity)
    n = len(family)
    if not n:
        return "No comparisons."
    z = NormalDist().inv_cdf
    # Two runs that agree on every sample have no spread to test against: left out.
    detectable = family["detectable"][family["detectable"] > 0]
    identical = n - len(detectable)
    # The same standard error at an unadjusted level: only the normal quantile changes.
    unadjusted = detectable * ((z(1 - SIGNIFICANCE / 2) + z(POWER)) / (z(1 - SIGNIFICANCE / (2 * n)) + z(POWER)))
    unit, decimals = quantity.unit, quantity.decimals
    settled_rows = (family["p_settled"].fillna(True).astype(bool) if "p_settled" in family
                    else pd.Series(True, index=family.index))
    marks = (
        f"The family is the table's {n} distinct comparisons (a pair of policies shows twice, once from each side, "
        f"and counts once). Intervals and p-values are per comparison, unadjusted; marks are adjusted over the "
        f"family: `*` Holm-adjusted p < {SIGNIFICANCE} (family-wise error {SIGNIFICANCE:.0%}), `+` "
        f"Benjamini-Hochberg q < {SIGNIFICANCE} but not Holm (false-discovery rate {SIGNIFICANCE:.0%}); an "
        f"unmarked difference is not a finding even where its interval excludes zero. Of the {n}: "
        f"{int((family['p'] < SIGNIFICANCE).sum())} have unadjusted p < {SIGNIFICANCE}, "
        f"{int(((family['p_bh'] < SIGNIFICANCE) & settled_rows).sum())} pass BH, "
        f"{int(((family['p_holm'] < SIGNIFICANCE) & settled_rows).sum())} pass Holm."
    )
    units = family["units"].dropna().astype(int) if "units" in family else pd.Series(dtype=int)
    if len(units):
        smallest = min(smallest_p(int(u)) for u in units)
        marks += (f" Smallest p this design can reach: {smallest:.3g} (the fewest units of a comparison here: "
                  f"{int(units.min())} samples or clusters; every sign pattern counted up to {EXACT_UP_TO}, else "
                  f"at most {MAX_FLIPS:,} random ones); Holm's first step needs p < {SIGNIFICANCE}/{n} = "
                  f"{SIGNIFICANCE / n:.3g}: "
                  + ("the family can decide." if family_decides(family) else
                     "the family cannot decide anything, so it enters no verdict."))
    unsettled = int((~settled_rows).sum())
    if unsettled:
        marks += (f" `?`: {unsettled} comparison(s) whose mark 10,000,000 random sign patterns could not settle "
                  f"(adjusted p within 4 Monte Carlo standard errors of {SIGNIFICANCE}): unmarked, counted as "
                  "undecided.")
    if detectable.empty:
        return marks + "\n\nNo comparison has two runs that differ on any sample: no detectable difference to give."
    return marks + (
        f"\n\nSmallest true difference of the average found with {POWER:.0%} power (normal approximation from each "
        f"comparison's paired standard error): median {detectable.median():.{decimals}f} {unit} "
        f"(range {detectable.min():.{decimals}f} to {detectable.max():.{decimals}f}) at Holm's strictest level "
        f"{SIGNIFICANCE}/{n}, the level a single true difference must reach whatever the others do; median "
        f"{unadjusted.median():.{decimals}f} {unit} at an unadjusted {SIGNIFICANCE}."
        + (f" Left out: {identical} comparison(s) of runs identical on every sample." if identical else "")
    )


def shared_engine_note(frame: pd.DataFrame) -> list[str]:
    """Timings of cells that shared one engine are the group's, not an isolated run's: say so."""
    shared = frame.drop_duplicates("run_dir")
    shared = shared[~shared["isolated"].fillna(True).astype(bool)] if "isolated" in shared else shared.iloc[:0]
    if shared.empty:
        return []
    return [f"Timing, KV-block and eviction-share columns of {len(shared)} run(s) are those of an engine "
            "shared by the sweep's cells (each prompt prefilled once, every cell's requests batched together; "
            "`perf.json` `isolated: false`): they are not comparable with isolated runs. Throughput and memory "
            "comparisons come from `experiments/throughput.py`.", ""]


def interval_method(quantity: Quantity) -> str:
    """How a table's intervals are computed (``harness.analysis.stats.bca_interval``), in words."""
    return (f"95% BCa bootstrap intervals (bias-corrected and accelerated, tasks resampled within themselves; the "
            f"bootstrap distribution computed exactly where the samples take so few values that at most "
            f"{EXACT_OUTCOMES:,} distinct resamples exist, as for 0/1 scores; otherwise {RESAMPLES:,} resamples at "
            f"first and more, up to {MAX_RESAMPLES:,}, until each bound's Monte Carlo error (standard error from "
            f"{SECTIONS} sections of the resamples) is below {quantity.mc_target:g} {quantity.unit}, each interval's "
            f"resamples drawn from a generator seeded by a hash of its own data)")


INTERVAL_METHOD = interval_method(SCORE)


def differences_text(quantity: Quantity) -> str:
    better = "higher is better" if quantity.higher_is_better else "lower is better"
    return (f"Paired differences of the average {quantity.description} ({quantity.units}, {better}; row minus column, "
            f"same samples; columns other than full cache compare policies at the row's budget) with two-sided "
            f"p-values of the stratified sign-flip test (`harness.analysis.stats._Stratified`: the difference over its "
            f"stratified standard error, against the same statistic with the signs of the samples' deviations from "
            f"their task's mean flipped within each task, whole clusters together where samples share one; every "
            f"sample takes part the same way at every shift, equal answers included) and the 95% interval that "
            f"inverts the same test: the shifts s for which it does not reject at {SIGNIFICANCE}, the difference -+ "
            f"the critical value x the standard error, so an interval excludes zero exactly when its p < "
            f"{SIGNIFICANCE}. Every sign pattern counted where a comparison has at most {EXACT_UP_TO} samples (or "
            f"clusters); else random patterns seeded by a hash of the comparison's own differences: p-values from "
            f"{FLIPS:,}, ten times more (up to {MAX_FLIPS:,}) for every p-value a mark of the table depends on while "
            f"that mark could change within {WIDTH} Monte Carlo standard errors; bounds from the same patterns and "
            f"more, up to {MAX_RESAMPLES:,}, until each bound's Monte Carlo error from {SECTIONS} sections of them is "
            f"below {quantity.mc_target:g} {quantity.unit}. p-values are printed to the significant digits (at least "
            f"3) from which the table's marks follow.")


def interval_note(group: pd.DataFrame, quantity: Quantity) -> str:
    """The largest Monte Carlo error of a bound in an interval table (``interval_table``)."""
    errors = pd.concat([group[f"{quantity.task_column}_mc"],
                        group.drop_duplicates("run_dir")[f"{quantity.average_column}_mc"]]).dropna()
    exact = "" if errors.max() > 0 else " (every bootstrap distribution here computed exactly)"
    return (f"Monte Carlo error of the bounds (standard error): at most {errors.max():.3g} {quantity.unit} in this "
            f"table (target below {quantity.mc_target:g}){exact}.")


def monte_carlo_note(family: pd.DataFrame, quantity: Quantity) -> str:
    """How much a differences table's bounds and p-values owe to their random draws: the largest
    Monte Carlo error of a bound, how many p-values are exact and how many random (with their
    flips and largest standard error), and any comparison whose mark is not settled."""
    random = family[family["p_flips"] > 0]
    text = (f"Monte Carlo error (standard error; a rerun draws the same): bounds at most {family['mc'].max():.3g} "
            f"{quantity.unit} (target below {quantity.mc_target:g}); ")
    if random.empty:
        return text + f"all {len(family)} p-values exact."
    fewest, most = int(random["p_flips"].min()), int(random["p_flips"].max())
    exact = len(family) - len(random)
    text += (f"{exact} p-value{'' if exact == 1 else 's'} exact, {len(random)} from "
             f"{f'{fewest:,}' if fewest == most else f'{fewest:,} to {most:,}'} random sign patterns (standard error "
             f"at most {random['p_mc'].max():.2g}).")
    unsettled = family[family["p_settled"].astype(str) == "False"]  # read back from a CSV, a bool is text
    if unsettled.empty:
        return text + f" No mark could change within {WIDTH} standard errors of the random p-values."
    names = ", ".join(f"{row[0]} {row[1]} minus {column[0]}"
                      for row, column in zip(unsettled["row"], unsettled["column"]))
    return text + (f" Not settled at {MAX_FLIPS:,} patterns: the mark of {names} could change within {WIDTH} "
                   f"standard errors of the random p-values.")


def quantity_sections(group: pd.DataFrame, quantity: Quantity, margin: float | None = None) -> list[str]:
    """Values with intervals, then the differences table and its note, for a per-sample quantity
    other than the score; only where every run of the group recorded it."""
    if quantity.average_column not in group or group[quantity.average_column].isna().any():
        return []
    better = "higher is better" if quantity.higher_is_better else "lower is better"
    runs = with_budget_label(group.drop_duplicates("run_dir")).set_index("run_dir")
    missing = group.groupby("run_dir")["samples"].sum() - runs[f"{quantity.field}_samples"]
    missing = missing[missing > 0]
    left_out = "" if missing.empty else (
        f" Samples without a value are left out of their run's statistics and its pairs: "
        + ", ".join(f"{runs.loc[run, 'variant']} {runs.loc[run, 'budget']} {int(n)}" for run, n in missing.items()) + ".")
    return [
        f"### {quantity.description[0].upper()}{quantity.description[1:]}",
        "",
        f"Per task and averaged over tasks ({quantity.units}, {better}), with {interval_method(quantity)}.{left_out}",
        "",
        markdown_table(interval_table(group, quantity)),
        "",
        interval_note(group, quantity),
        "",
        *differences_section(group, quantity, margin),
    ]


def verdict_text(quantity: Quantity, margin: float | None) -> str:
    """What the verdict word after each difference means (``harness.analysis.verdicts``)."""
    if quantity is not SCORE or margin is None:
        return ("Verdicts: `better` / `worse` where Holm decides (row against column, "
                f"{'higher' if quantity.higher_is_better else 'lower'} is better), else `inconclusive` (no margin is "
                "stated for this signal, so nothing here says two are alike).")
    return (f"Verdicts at the study's margin of {margin:g} {quantity.unit} (`harness.analysis.studies`): `better` / "
            f"`worse` where Holm decides (row against column); else `equivalent` where the 95% interval lies inside "
            f"(-{margin:g}, +{margin:g}) (two one-sided tests at 2.5% each), `non-inferior` where its lower bound "
            f"lies above -{margin:g} (one-sided at 2.5%: the row is not worse by {margin:g} or more), else "
            "`inconclusive`. Undecided is not level: only `equivalent` says two are alike.")


def differences_section(group: pd.DataFrame, quantity: Quantity, margin: float | None = None) -> list[str]:
    """The differences table of one quantity with the text above and below it."""
    family = table_comparisons(group, quantity)
    if not len(family):
        return ["No paired differences: no two runs here compare (full cache alone, or one variant).", ""]
    return [differences_text(quantity), "", verdict_text(quantity, margin), "",
            markdown_table(differences_table(group, quantity, margin)), "",
            monte_carlo_note(family, quantity), "", family_note(group, quantity), ""]


def to_markdown(frame: pd.DataFrame, command: str, margin: float | None = DEFAULT_MARGIN) -> str:
    parts = []
    for (model, data), group in frame.groupby(["model.name", "data.name"]):
        per_task = group.drop_duplicates("task").set_index("task")["samples"]
        counts = ", ".join(f"{task} {int(n)}" for task, n in per_task.items())
        parts += [
            f"## {model} on {data}",
            "",
            f"Task scores (0-100, each task by its own metric: `metric` in scores.json) with {INTERVAL_METHOD}; `average` is the unweighted mean of the "
            f"task scores. Samples per task: {counts}.",
            "",
            markdown_table(interval_table(group)),
            "",
            interval_note(group, SCORE),
            "",
            *differences_section(group, SCORE, margin),
            *silence_section(group, group_scores(group)),
            *[line for quantity in QUANTITIES if quantity is not SCORE
              for line in quantity_sections(group, quantity, margin)],
            "Retention of the average score against full cache (%), fidelity to full cache (%), throughput "
            "(output tokens/s and ratio to full cache), median time per output token (s), KV blocks in use "
            "(peak, mean), eviction work as a share of step time.",
            "",
            markdown_table(system_table(group)),
            "",
            *shared_engine_note(group),
        ]
    return "\n".join([f"# Summary\n\nProduced by `{command}`\n", *parts])


def write_summary(frame: pd.DataFrame, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "summary.csv", frame.to_csv(index=False))
    atomic_write_text(out / "summary.md", to_markdown(frame, command, margin_for(out)))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/summary"))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--drop-task", action="append", default=[], metavar="TASK",
                        help="leave a task out of every table (repeatable), e.g. RULER's vt")
    args = parser.parse_args(argv)
    missing = sorted(set(args.drop_task) - {t for run in find_runs(args.roots)
                                              for t in read_json(run / "scores.json")["tasks"]})
    if missing:  # a misspelt task would leave every table as it was, under a name that says otherwise
        parser.error(f"--drop-task: no run has task(s) {', '.join(missing)}")
    frame = load_runs(args.roots, tuple(args.drop_task))
    command = "python -m harness.analysis.aggregate " + " ".join(argv)
    write_summary(frame, args.out, command)
    if not args.no_plots:
        from harness.analysis.plots import plot_all

        plot_all(frame, args.out)
    print(to_markdown(frame, command, margin_for(args.out)))
    print(f"[aggregate] {len(frame)} rows from {frame['run_dir'].nunique()} runs -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""An independent recomputation of the committed paired-difference intervals (issue 51), sharing
no code with ``harness/`` or ``policies/``: it reads ``summary.csv`` only for which comparisons a
table holds and what it printed, and the runs' ``predictions.jsonl`` for the samples.

    .venv/bin/python tests/support/recompute_intervals.py results/layer_budgets_suite [more folders]
    .venv/bin/python tests/support/recompute_intervals.py --agreement   # every committed summary.csv

The interval is the set of shifts s for which the two-sided stratified, studentized sign-flip test
of "the mean difference is s" does not reject at 0.05 (``interval``); its bounds are found by bisection. The statistic is
the mean over tasks of the task means, so sample i of task t weighs 1 / (tasks x samples of t).
Where a comparison has at most 20 samples every sign pattern is counted; otherwise 400,000 random patterns from numpy's default generator
(seed 20261127), so a bound differs from the committed one by Monte Carlo error (both sides'
errors count). Zero is judged by the test's own p-value at zero (exact when at most 20 samples
differ), as the committed intervals are: that is what makes an interval exclude zero exactly when
p < 0.05, whatever the test does at other shifts.

``--agreement`` walks every summary.csv and comparisons.csv under results/, and each served
workload's accuracy.csv (its ``vs_full_low``/``vs_full_high`` beside ``p``), and counts comparisons
whose interval and p-value disagree (interval excluding zero beside p >= 0.05, or containing it
beside p < 0.05).
"""
from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

try:
    from tests.support.recompute_marks import label  # a cell's budget label: "256", "r0.5", "all"
except ImportError:  # run as a script from tests/support
    from recompute_marks import label

ROOT = Path(__file__).resolve().parents[2]
ALPHA = 0.05
EXACT = 20  # samples up to which every sign pattern is counted
PATTERNS = 400_000
SEED = 20261127
FIELDS = {"score": ("", 100), "answer_logprob": ("answer_logprob_", 1), "top1_agreement": ("top1_agreement_", 100),
          "kl_to_full": ("kl_to_full_", 1)}


# ---------------------------------------------------------------- agreement of committed intervals and p
def summaries(root: Path = ROOT) -> list[Path]:
    """Every machine-readable summary of comparisons under results/: each summary.csv and
    comparisons.csv, and each served workload's accuracy.csv (run directories left out)."""
    return sorted(p for name in ("summary.csv", "comparisons.csv", "accuracy.csv") for p in (root / "results").rglob(name)
                  if "runs" not in p.relative_to(root).parts)


def read_summary(path: Path) -> pd.DataFrame:
    """A summary's frame, a served workload's accuracy.csv with its one comparison (each
    configuration minus full cache, ``vs_full_low``/``vs_full_high``, its test's ``p``) under the
    stem ``vs_full_`` like every other table's."""
    frame = pd.read_csv(path, low_memory=False)
    return frame.rename(columns={"p": "vs_full_p"}) if path.name == "accuracy.csv" else frame


def comparisons(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(row index, stem) of every comparison the frame prints with an interval and a p-value:
    columns ``<stem>low``, ``<stem>high`` and ``<stem>p`` all present (a stem ends in "_" or is empty). A summary.csv has a row
    per (run, task) and repeats a run's average-level columns (``avg_`` in the stem) in each of its
    rows: those are counted once per run."""
    stems = [c[:-1] for c in frame.columns if c.endswith("p") and f"{c[:-1]}low" in frame and f"{c[:-1]}high" in frame
             and (c == "p" or c.endswith("_p"))]  # "p": a comparisons.csv's one comparison per row
    found = []
    for stem in stems:  # row labels only: a summary has a thousand columns, not worth copying per stem
        rows = frame.index[frame[f"{stem}p"].notna()]
        if "avg_vs_" in stem and "run_dir" in frame:
            rows = rows[~frame.loc[rows, "run_dir"].duplicated().to_numpy()]
        found += [(index, stem) for index in rows]
    return found


def disagreements(root: Path = ROOT) -> tuple[int, list[str]]:
    """How many comparisons the committed summaries hold, and each whose interval and p disagree.
    A comparison of two policies is printed from both sides (A minus B in A's rows, B minus A in
    B's) and counted from each."""
    total, found = 0, []
    for path in summaries(root):
        frame = read_summary(path)
        for index, stem in comparisons(frame):
            low, high, p = (float(frame.at[index, f"{stem}{part}"]) for part in ("low", "high", "p"))
            total += 1
            if (low > 0 or high < 0) != (p < ALPHA):
                where = frame.at[index, "run_dir"] if "run_dir" in frame else index
                task = f" {frame.at[index, 'task']}" if "task" in frame and "avg_vs_" not in stem else ""
                found.append(f"{path.relative_to(root)}: {where}{task} {stem.rstrip('_')}: ({low}, {high}) p={p:.4g}")
    return total, found


# ---------------------------------------------------------------- the interval, recomputed
def bound(accepts, estimate: float, p_zero: float, side: int, span: float) -> float:
    """The end of the accepted shifts on ``side``: bisection between an accepted and a rejected shift,
    zero judged by ``p_zero``."""
    if (0 - estimate) * side > 0 and p_zero < ALPHA:
        inside, outside = estimate, 0.0
    else:
        inside = 0.0 if (0 - estimate) * side > 0 else estimate
        outside = inside + side * span
        while accepts(outside):
            outside = inside + 2 * (outside - inside)
            if abs(outside) > 1e6 * span:
                return side * math.inf
    for _ in range(60):
        middle = (inside + outside) / 2
        inside, outside = (middle, outside) if accepts(middle) else (inside, middle)
    return inside


def interval(differences: dict[str, np.ndarray], scale: float) -> tuple[float, float, float, float]:
    """(estimate, low, high, p) x ``scale`` of the per-task differences, by the stratified,
    studentized sign-flip test (issue 65): Z(s) = (estimate - s) / SE, SE^2 the stratified
    variance sum_t n_t/(n_t-1) sum (x_i - mean_t x)^2 of the weighted differences x_i; the
    reference flips the signs of the within-task deviations r_i = x_i - mean_t x and recomputes the
    same ratio; p(s) = (1 + #{|Z*| >= |Z(s)|}) / (1 + patterns); every pattern where there are at
    most 20 samples, else 400,000 random ones."""
    tasks = sorted(differences)
    d = np.concatenate([differences[t] for t in tasks])
    w = np.concatenate([np.full(len(differences[t]), 1 / (len(differences[t]) * len(tasks))) for t in tasks])
    task = np.concatenate([np.full(len(differences[t]), i) for i, t in enumerate(tasks)])
    x = d * w
    estimate = float(x.sum())
    if not np.any(x != 0):
        return 0.0, 0.0, 0.0, 1.0
    r = x.copy()
    n = np.array([np.sum(task == i) for i in range(len(tasks))], dtype=float)
    for i in range(len(tasks)):
        r[task == i] -= x[task == i].mean()
    factor = np.where(n > 1, n / np.maximum(n - 1, 1), 0.0)
    squares = np.array([np.sum(r[task == i] ** 2) for i in range(len(tasks))])
    se = math.sqrt(float(np.sum(factor * squares)))

    def reference(signs: np.ndarray) -> np.ndarray:
        per_task = np.stack([signs[:, task == i] @ r[task == i] for i in range(len(tasks))], axis=1)
        variance = np.sum(factor * (squares - per_task ** 2 / n), axis=1)
        total = np.abs(per_task.sum(axis=1))
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(total > 1e-15, total / np.sqrt(np.maximum(variance, 0)), 0.0)
        return z

    if len(x) <= 20:
        codes = np.arange(2 ** len(x))
        z = np.concatenate([reference(((codes[i:i + 65536, None] >> np.arange(len(x))) & 1) * 2.0 - 1.0)
                            for i in range(0, len(codes), 65536)])
    else:
        rng = np.random.default_rng(SEED)
        z = np.concatenate([reference(rng.choice([-1.0, 1.0], size=(50_000, len(x))))
                            for _ in range(PATTERNS // 50_000)])

    def p_at(s: float) -> float:
        observed = abs(estimate - s) / se if se > 0 else (math.inf if estimate != s else 0.0)
        return (1 + np.count_nonzero(z >= observed * (1 - 1e-9))) / (1 + len(z))

    p_zero = p_at(0.0)
    span = float(np.abs(d).max() + abs(estimate))
    low, high = (bound(lambda s: p_at(s) >= ALPHA, estimate, p_zero, side, span) for side in (-1, 1))
    return scale * estimate, scale * low, scale * high, p_zero


@functools.lru_cache(maxsize=None)
def samples(run_dir: str, field: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in (ROOT / run_dir / "predictions.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get(field) is not None:
            out.setdefault(row["task"], {})[row["id"]] = float(row[field])
    return out


def paired(a: dict, b: dict, tasks: set[str]) -> dict[str, np.ndarray]:
    out = {}
    for task in sorted(set(a) & set(b) & tasks):
        ids = sorted(set(a[task]) & set(b[task]))
        out[task] = np.array([a[task][i] - b[task][i] for i in ids])
    return out


def recompute(folder: Path, field: str, variant: str, budget: str, other: str, task: str | None = None
              ) -> dict[str, tuple[float, ...]]:
    """One comparison of ``folder``'s table: ``variant`` at ``budget`` minus ``other`` (at the same
    budget, or full cache), on the average or on ``task``: the committed (diff, low, high, mc, p) and
    the recomputed (diff, low, high, p)."""
    frame = pd.read_csv(folder / "summary.csv", low_memory=False)
    prefix, scale = FIELDS[field]
    runs = frame.drop_duplicates("run_dir")
    this = next(r for _, r in runs.iterrows() if r["variant"] == variant and label(r) == budget)
    that = next(r for _, r in runs.iterrows() if r["variant"] == other and label(r) in (budget, "all"))
    tasks = set(frame["task"])
    differences = paired(samples(this["run_dir"], field), samples(that["run_dir"], field), tasks)
    if task is None:
        row, stem = this, f"{prefix}avg_vs_{other}"
    else:
        row = frame[(frame["run_dir"] == this["run_dir"]) & (frame["task"] == task)].iloc[0]
        stem, differences = f"{prefix}vs_{other}", {task: differences[task]}
    committed = tuple(float(row[f"{stem}_{part}"]) for part in ("diff", "low", "high", "mc", "p"))
    return {"committed": committed, "recomputed": interval(differences, scale)}


def main(argv: list[str]) -> int:
    if argv == ["--agreement"]:
        total, found = disagreements()
        print(f"{total} committed comparisons, {len(found)} whose interval and p disagree")
        for line in found[:50]:
            print("  " + line)
        return 1 if found else 0
    for folder in argv:
        frame = pd.read_csv(Path(folder) / "summary.csv", low_memory=False)
        runs = frame.drop_duplicates("run_dir")
        for _, run in runs.iterrows():
            for column in run.index:
                if column.startswith("avg_vs_") and column.endswith("_diff") and run[column] == run[column]:
                    other = column[len("avg_vs_"):-len("_diff")]
                    result = recompute(Path(folder), "score", run["variant"], label(run), other)
                    c, r = result["committed"], result["recomputed"]
                    print(f"{folder} {run['variant']} {label(run)} minus {other}: committed {c[0]:+.2f} "
                          f"({c[1]:+.2f}, {c[2]:+.2f}) p={c[4]:.4g}; recomputed {r[0]:+.2f} ({r[1]:+.2f}, {r[2]:+.2f}) "
                          f"p={r[3]:.4g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

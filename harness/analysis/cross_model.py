"""One study run on two models, side by side: where their verdicts agree and where they do not.

    python -m harness.analysis.cross_model results/cpu_accuracy results/cpu_accuracy_gemma3 --out results/cross_model/suite

Two runs of a study (issue 66, item 4) have the same cells (policy x budget, or policy x
budget_ratio) and the same samples (ids per task; prompts differ only by tokenizer); anything else
is refused in one line. Per cell, each model's average score with its 95% interval and its paired
difference from full cache (interval, Holm-adjusted p, verdict), read from each study's own
``summary.csv`` (``harness.analysis.aggregate``: the same family, the same adjustment, the same
verdict words), recomputed from its runs only where that summary is absent or does not match
them. Then which comparisons against full cache decide the same way on both models, and per
budget how alike the two orders of policies are: Kendall's tau-b between the two models' cell
averages, with a 95% BCa interval from a paired bootstrap that resamples sample ids within each
task, the same ids for both models. Only the primary signal, the task score, is compared (the
second model's studies record no likelihood signals).

Writes ``summary.md`` (also printed), ``summary.csv`` (one row per cell), ``orders.csv`` (one row
per budget) and ``cross_model.png``/``.pdf`` (each cell's average on one model against the other,
both intervals drawn).
"""
from __future__ import annotations

import argparse
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.analysis.aggregate import (SCORE, SIGNIFICANCE, comparison_verdict, family_decides, find_runs,
                                        load_runs, sample_scores, settled, significance_mark, table_comparisons)
from harness.analysis.labels import budget_label, in_reading_order, markdown_table, signed, with_interval
from harness.analysis.report import budget_key, read_summary
from harness.analysis.stats import (EXACT_UP_TO, MAX_FLIPS, MAX_RESAMPLES, RESAMPLES, SECTIONS, _bca_bounds,
                                    _bounds_error, data_seed, smallest_p)
from harness.analysis.studies import ROOT, STUDIES, margin_for
from harness.analysis.verdicts import ACROSS_MODELS
from harness.records.results import atomic_write_text, read_json

FULL = "avg_vs_full"  # the column stem of a cell's paired difference from full cache (aggregate's)
DECIDED = ("better", "worse")  # the verdicts Holm decides (harness.analysis.verdicts)
# Largest Monte Carlo standard error of a tau bound: four of them (stats.WIDTH) stay within 0.01.
TAU_TARGET = 0.0025
_DRAWS_AT_ONCE = 1 << 15  # bootstrap draws evaluated together (bounds memory: draws x samples)
_TIE = 1e-9  # two averages closer than this are tied (sums of the same scores in another order)


class Refused(ValueError):
    """Two studies that cannot be compared cell by cell; the message is one line."""


@dataclass(frozen=True)
class StudyRuns:
    """One model's run of a study: its cells (one row each, indexed by ``(data, variant, budget
    label)``, the study's own summary columns, ``verdict`` against full cache and ``local_run``,
    the run directory under ``root``), each cell's per-sample scores, and per data the study's own
    family of comparisons (``table_comparisons``: beside cells included, as its summary adjusts)."""
    root: Path
    model: str
    source: str
    margin: float
    cells: pd.DataFrame
    scores: dict[tuple[str, str, str], dict[str, pd.Series]]
    families: dict[str, pd.DataFrame]


def cell_key(row) -> tuple[str, str, str]:
    return (row["data.name"], row["variant"], budget_label(row))


def cell_name(key: tuple[str, str, str]) -> str:
    return f"{key[1]} {key[2]}"


def beside_roots(root: Path) -> list[Path]:
    """The folders a committed study's summary shows beside its own cells (``Study.beside``)."""
    for study in STUDIES:
        if (ROOT / "results" / study.folder).resolve() == root.resolve():
            return [ROOT / folder for folder in study.beside]
    return []


def study_frame(root: Path, runs: dict[tuple[str, ...], Path]) -> tuple[pd.DataFrame, str]:
    """The study's aggregate frame: its ``summary.csv`` when that lists exactly the complete runs
    under ``root`` with the averages their ``scores.json`` give, else recomputed from the runs (with
    the folders a committed study is summarised beside), and where it came from, in words."""
    path = root / "summary.csv"
    if path.exists():
        frame = read_summary(root)
        listed = frame.drop_duplicates("run_dir")
        own = {Path(run).parts[-3:]: average for run, average in zip(listed["run_dir"], listed["average"])
               if Path(run).parts[-3:] in runs}
        current = set(own) == set(runs) and all(
            math.isclose(average, read_json(runs[tail] / "scores.json")["average"], abs_tol=0.005)
            for tail, average in own.items())
        if current:
            return frame, f"its `{path.name}`"
        why = "does not match its runs"
    else:
        why = "is absent"
    roots = [root, *beside_roots(root)]
    return load_runs(roots), (f"recomputed by `harness.analysis.aggregate` from {', '.join(map(str, roots))} "
                              f"(its summary.csv {why})")


def read_study(root: Path) -> StudyRuns:
    runs = {run.parts[-3:]: run for run in find_runs([root])}
    if not runs:
        raise Refused(f"refused: no complete run directory under {root}")
    frame, source = study_frame(root, runs)
    tails = [Path(r).parts[-3:] for r in frame["run_dir"]]
    own = frame[[tail in runs for tail in tails]].drop_duplicates("run_dir").copy()
    models = sorted(own["model.name"].unique())
    if len(models) != 1:
        raise Refused(f"refused: {root} holds {len(models)} models ({', '.join(models)}); give one study of one model")
    own["local_run"] = [str(runs[Path(r).parts[-3:]]) for r in own["run_dir"]]
    own.index = pd.MultiIndex.from_tuples([cell_key(row) for _, row in own.iterrows()], names=["data", "variant", "budget"])
    if own.index.has_duplicates:
        twice = sorted({cell_name(key) for key in own.index[own.index.duplicated()]})
        raise Refused(f"refused: {root} has more than one run of {', '.join(twice)}")
    margin = margin_for(root)
    families, verdicts = {}, []
    for data in sorted(own.index.unique("data")):
        group = frame[(frame["model.name"] == models[0]) & (frame["data.name"] == data)]
        families[data] = table_comparisons(group)
    for key, row in own.iterrows():
        family = families[key[0]]
        decidable = family_decides(family) if len(family) else True
        verdicts.append("" if row["policy.name"] == "full" else
                        comparison_verdict(row, FULL, SCORE, margin, decidable))
    own["verdict"] = verdicts
    scores = {key: sample_scores(row["local_run"]) for key, row in own.iterrows()}
    return StudyRuns(root, models[0], source, margin, own, scores, families)


def refuse_unless_comparable(a: StudyRuns, b: StudyRuns) -> None:
    """The same cells and, cell by cell, the same sample ids per task; else ``Refused``, one line."""
    only_a = sorted(set(a.cells.index) - set(b.cells.index))
    only_b = sorted(set(b.cells.index) - set(a.cells.index))
    if only_a or only_b:
        listed = "; ".join(f"only in {s.root}: {', '.join(map(cell_name, cells[:5]))}"
                           + (f" and {len(cells) - 5} more" if len(cells) > 5 else "")
                           for s, cells in ((a, only_a), (b, only_b)) if cells)
        raise Refused(f"refused: {a.root} and {b.root} do not have the same cells ({listed})")
    for key in sorted(a.cells.index):
        tasks_a, tasks_b = a.scores[key], b.scores[key]
        if set(tasks_a) != set(tasks_b):
            raise Refused(f"refused: {a.root} and {b.root} scored different tasks in {cell_name(key)} "
                          f"({', '.join(sorted(set(tasks_a) ^ set(tasks_b)))})")
        for task in sorted(tasks_a):
            ids_a, ids_b = set(tasks_a[task].index), set(tasks_b[task].index)
            if ids_a != ids_b:
                raise Refused(f"refused: {a.root} and {b.root} did not score the same samples: {cell_name(key)} "
                              f"{task} has {len(ids_a - ids_b)} ids only in the first (e.g. "
                              f"{', '.join(sorted(ids_a - ids_b)[:2]) or '-'}) and {len(ids_b - ids_a)} only in the "
                              f"second (e.g. {', '.join(sorted(ids_b - ids_a)[:2]) or '-'})")
    for data in sorted(a.cells.index.unique("data")):
        if (data, "full", "all") not in a.cells.index:
            raise Refused(f"refused: no full cache cell on {data}: nothing to compare the cells with")


# ---------------------------------------------------------------- which comparisons decide alike
def agreement(verdict_a: str, verdict_b: str, name_a: str, name_b: str) -> str:
    """How one comparison against full cache decides on the two models: ``same direction on
    both``, ``opposite ways``, ``decided on <model> only`` or ``undecided on both`` (undecided is
    not level: two undecided comparisons are not an agreement)."""
    decided_a, decided_b = verdict_a in DECIDED, verdict_b in DECIDED
    if decided_a and decided_b:
        return ACROSS_MODELS[0] if verdict_a == verdict_b else ACROSS_MODELS[1]
    if decided_a or decided_b:
        return (ACROSS_MODELS[2] if decided_a else ACROSS_MODELS[3]).format(a=name_a, b=name_b)
    return ACROSS_MODELS[4]


# ---------------------------------------------------------------- the order of policies
def kendall_tau(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall's tau-b of each row of ``x`` against the same row of ``y`` (rows: draws; columns:
    policies): concordant minus discordant pairs over the square root of the untied pairs on each
    side (ties within ``_TIE`` count as neither); nan where every policy ties on one side."""
    x, y = np.atleast_2d(x), np.atleast_2d(y)
    first, second = np.triu_indices(x.shape[1], 1)
    signs_x = np.where(np.abs(d := x[:, first] - x[:, second]) <= _TIE, 0.0, np.sign(d))
    signs_y = np.where(np.abs(d := y[:, first] - y[:, second]) <= _TIE, 0.0, np.sign(d))
    untied = np.count_nonzero(signs_x, axis=1) * np.count_nonzero(signs_y, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(untied > 0, (signs_x * signs_y).sum(axis=1) / np.sqrt(untied), np.nan)


@dataclass(frozen=True)
class Order:
    """Kendall's tau-b between two models' cell averages at one budget, with its 95% BCa interval
    (nan where undefined), the bounds' Monte Carlo standard error, the bootstrap draws behind them
    and how many of those drew every policy tied on a model (tau undefined: left out)."""
    data: str
    budget: str
    policies: int
    tau: float
    low: float
    high: float
    mc_error: float
    resamples: int
    undefined: int

    @property
    def reading(self) -> str:
        if self.tau != self.tau:
            return "undefined: every policy ties on a model"
        if self.low > 0:
            return "excludes 0: the orders agree"
        if self.high < 0:
            return "excludes 0: the orders are opposed"
        return "includes 0: not told apart from unrelated orders"


def _averages(matrices: list[np.ndarray], weights: list[np.ndarray]) -> np.ndarray:
    """Each cell's average, the mean over tasks of the task means (the study's ``average``), under
    per-sample weights (draws x samples: how often a resample takes each sample)."""
    return sum(w @ m.T / m.shape[1] for w, m in zip(weights, matrices)) / len(matrices)


def _drawn_taus(matrices: list[np.ndarray], policies: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` bootstrap taus: each task's sample ids drawn with replacement, the same ids for
    every cell of both models."""
    taus = []
    for start in range(0, count, _DRAWS_AT_ONCE):
        draws = min(_DRAWS_AT_ONCE, count - start)
        weights = []
        for matrix in matrices:
            size = matrix.shape[1]
            picks = rng.integers(0, size, size=(draws, size)) + size * np.arange(draws)[:, None]
            weights.append(np.bincount(picks.ravel(), minlength=draws * size).reshape(draws, size).astype(float))
        averages = _averages(matrices, weights)
        taus.append(kendall_tau(averages[:, :policies], averages[:, policies:]))
    return np.concatenate(taus)


def _jackknife_acceleration(matrices: list[np.ndarray], policies: int) -> float:
    """BCa's acceleration for tau: the skew of its jackknife (one sample id left out of its task,
    on both models, the averages and tau recomputed; Efron 1987)."""
    means = [m.mean(axis=1) for m in matrices]
    total = sum(means)
    values = []
    for index, matrix in enumerate(matrices):
        size = matrix.shape[1]
        if size < 2:
            continue
        left_out = (matrix.sum(axis=1)[None, :] - matrix.T) / (size - 1)  # samples x cells
        averages = (total - means[index] + left_out) / len(matrices)
        values.append(kendall_tau(averages[:, :policies], averages[:, policies:]))
    taus = np.concatenate(values) if values else np.zeros(0)
    spread = np.nanmean(taus) - taus[~np.isnan(taus)] if len(taus) else taus
    denominator = 6 * np.sum(spread ** 2) ** 1.5
    return float(np.sum(spread ** 3) / denominator) if denominator > 0 else 0.0


def order_agreement(data: str, budget: str, cells_a: list[dict[str, pd.Series]], cells_b: list[dict[str, pd.Series]],
                    target: float = TAU_TARGET, max_resamples: int = MAX_RESAMPLES) -> Order:
    """Kendall's tau-b between the two models' averages of the same policies (``cells_a[i]`` and
    ``cells_b[i]``: one policy's per-sample scores per task on each model) and its 95% BCa
    interval: the bootstrap resamples sample ids within each task, the same for both models, from
    a generator seeded by a hash of the scores themselves (``stats.data_seed``); ``RESAMPLES``
    draws at first, doubled until both bounds' Monte Carlo standard error (``stats._bounds_error``,
    by sections) is below ``target`` or ``max_resamples`` is reached."""
    policies = len(cells_a)
    tasks = sorted(cells_a[0])
    matrices = []
    for task in tasks:
        ids = cells_a[0][task].index.sort_values()
        matrices.append(np.vstack([cell[task][ids].to_numpy(float) for cell in [*cells_a, *cells_b]]))
    averages = _averages(matrices, [np.ones((1, m.shape[1])) for m in matrices])
    estimate = float(kendall_tau(averages[:, :policies], averages[:, policies:])[0])
    if estimate != estimate:
        return Order(data, budget, policies, math.nan, math.nan, math.nan, 0.0, 0, 0)
    acceleration = _jackknife_acceleration(matrices, policies)
    rng = np.random.default_rng(data_seed("kendall_tau", [m.ravel() for m in matrices], tuple(tasks)))
    draws = _drawn_taus(matrices, policies, RESAMPLES, rng)
    while True:
        defined = draws[~np.isnan(draws)]
        error = _bounds_error(defined, estimate, acceleration)
        if error < target or len(draws) >= max_resamples:
            break
        draws = np.concatenate([draws, _drawn_taus(matrices, policies, min(len(draws), max_resamples - len(draws)), rng)])
    low, high = _bca_bounds(defined, estimate, acceleration)
    return Order(data, budget, policies, round(estimate, 4), round(float(low), 4), round(float(high), 4),
                 round(error, 4), len(draws), len(draws) - len(defined))


def orders(a: StudyRuns, b: StudyRuns, **options) -> list[Order]:
    """``order_agreement`` at every (data, budget label) of the two studies' evicting cells."""
    found = []
    evicting = [key for key in sorted(a.cells.index) if key[1] != "full"]
    for data, budget in sorted({(key[0], key[2]) for key in evicting}, key=lambda k: (k[0], budget_key(k[1]))):
        keys = [key for key in evicting if key[0] == data and key[2] == budget]
        found.append(order_agreement(data, budget, [a.scores[k] for k in keys], [b.scores[k] for k in keys], **options))
    return found


# ---------------------------------------------------------------- tables
def side_names(a: StudyRuns, b: StudyRuns) -> tuple[str, str]:
    """What the text calls each side: its model, or where both ran one model, its folder too."""
    if a.model != b.model:
        return a.model, b.model
    if str(a.root) != str(b.root):
        return f"{a.model} ({a.root})", f"{b.model} ({b.root})"
    return f"{a.model} (first)", f"{b.model} (second)"


def cells_frame(a: StudyRuns, b: StudyRuns) -> pd.DataFrame:
    """One row per cell: each side's average with its interval, its difference from full cache with
    the interval, p, Holm-adjusted p, verdict, rank among the evicting cells at its budget (1:
    highest average), and how the two verdicts agree."""
    name_a, name_b = side_names(a, b)
    rows = []
    for data in sorted(a.cells.index.unique("data")):
        here = a.cells.loc[data]  # indexed by (variant, budget label)
        for variant, budget in in_reading_order(here).index:
            row = {"data": data, "policy": variant, "budget": budget}
            for side, study in (("a", a), ("b", b)):
                cell = study.cells.loc[(data, variant, budget)]
                row.update({f"{side}_average": cell["average"], f"{side}_average_low": cell["average_low"],
                            f"{side}_average_high": cell["average_high"]})
                if variant == "full":
                    continue
                rivals = study.cells.loc[data].xs(budget, level="budget")
                rivals = rivals[rivals.index != "full"]
                row.update({f"{side}_minus_full": cell[f"{FULL}_diff"], f"{side}_minus_full_low": cell[f"{FULL}_low"],
                            f"{side}_minus_full_high": cell[f"{FULL}_high"], f"{side}_minus_full_p": cell[f"{FULL}_p"],
                            f"{side}_minus_full_p_holm": cell[f"{FULL}_p_holm"],
                            f"{side}_mark": significance_mark(cell[f"{FULL}_p_holm"], cell[f"{FULL}_p_bh"],
                                                              settled(cell, FULL)).strip(),
                            f"{side}_verdict": cell["verdict"],
                            f"{side}_rank": int((rivals["average"] > cell["average"]).sum()) + 1})
            if variant != "full":
                row["across_models"] = agreement(row["a_verdict"], row["b_verdict"], name_a, name_b)
            rows.append(row)
    frame = pd.DataFrame(rows)
    frame.insert(0, "b_study", str(b.root))
    frame.insert(0, "a_study", str(a.root))
    frame.insert(2, "a_model", a.model)
    frame.insert(3, "b_model", b.model)
    return frame


def difference_text(row, side: str) -> str:
    if row["policy"] == "full":
        return ""
    mark = f" {row[f'{side}_mark']}" if row[f"{side}_mark"] else ""
    return (f"{signed(row[f'{side}_minus_full'], 2)} ({signed(row[f'{side}_minus_full_low'], 2)}, "
            f"{signed(row[f'{side}_minus_full_high'], 2)}) p_holm={row[f'{side}_minus_full_p_holm']:.3g}{mark} "
            f"{row[f'{side}_verdict']}")


def cells_table(frame: pd.DataFrame, name_a: str, name_b: str) -> pd.DataFrame:
    table = pd.DataFrame({
        "policy": frame["policy"], "budget": frame["budget"],
        f"{name_a} average": [with_interval(r.a_average, r.a_average_low, r.a_average_high) for r in frame.itertuples()],
        f"{name_a} minus full": [difference_text(r, "a") for _, r in frame.iterrows()],
        f"{name_b} average": [with_interval(r.b_average, r.b_average_low, r.b_average_high) for r in frame.itertuples()],
        f"{name_b} minus full": [difference_text(r, "b") for _, r in frame.iterrows()],
        "rank (each model)": ["" if r["policy"] == "full" else f"{int(r['a_rank'])} / {int(r['b_rank'])}"
                              for _, r in frame.iterrows()],
        "across models": frame.get("across_models", pd.Series("", index=frame.index)).fillna(""),
    })
    return table.set_index(["policy", "budget"])


def orders_frame(found: list[Order]) -> pd.DataFrame:
    return pd.DataFrame([{"data": o.data, "budget": o.budget, "policies": o.policies, "kendall_tau": o.tau,
                          "low": o.low, "high": o.high, "mc_error": o.mc_error, "resamples": o.resamples,
                          "undefined_resamples": o.undefined, "interval": o.reading} for o in found])


def design_line(a: StudyRuns, b: StudyRuns, frame: pd.DataFrame, found: list[Order], name_a: str, name_b: str) -> str:
    """What the design can and cannot decide: samples per comparison, the smallest p they reach,
    each study's Holm family and whether it can decide, how many comparisons each decided, and the
    steps tau moves in."""
    evicting = frame[frame["policy"] != "full"]
    sides = []
    for side, study, name in (("a", a, name_a), ("b", b, name_b)):
        families = list(study.families.values())
        size = sum(len(f) for f in families)
        units = min(int(u) for f in families for u in f["units"].dropna()) if size else 0
        own = {(variant, budget) for _, variant, budget in study.cells.index}
        beside = sum(int(row not in own or column not in own) for f in families
                     for row, column in zip(f["row"], f["column"]))
        decides = all(family_decides(f) for f in families)
        decided = int(evicting[f"{side}_verdict"].isin(DECIDED).sum())
        sides.append(f"{name}: {decided} of {len(evicting)} decided against full cache, Holm over its summary's "
                     f"family of {size} comparisons" + (f" ({beside} of them with cells of the folders it is "
                                                        "summarised beside)" if beside else "")
                     + f", whose first step needs p < {SIGNIFICANCE}/{size} = {SIGNIFICANCE / max(size, 1):.3g}; a "
                     f"comparison of {units} paired samples reaches p = {smallest_p(units):.3g} at the smallest ("
                     + ("every sign pattern counted" if units <= EXACT_UP_TO else f"at most {MAX_FLIPS:,} random sign "
                        "patterns") + "), so " + ("it can decide" if decides else "it cannot decide anything"))
    counts = sorted({o.policies for o in found if o.policies > 1})
    steps = ", ".join(f"2/{n * (n - 1) // 2} = {4 / (n * (n - 1)):.3g}" for n in counts)
    return ("What this design can decide: " + "; ".join(sides) + ". The rest are undecided, not level. "
            f"The order of policies at a budget: Kendall's tau-b over {' or '.join(map(str, counts))} policies moves "
            f"in steps of {steps} (unevenly where averages tie).")


def classification_lines(frame: pd.DataFrame, name_a: str, name_b: str) -> list[str]:
    evicting = frame[frame["policy"] != "full"]
    classes = [c.format(a=name_a, b=name_b) for c in ACROSS_MODELS]
    counts = evicting["across_models"].value_counts()
    lines = [f"Of the {len(evicting)} comparisons against full cache (each model's own verdict, Holm over its own "
             "family): " + ", ".join(f"{int(counts.get(c, 0))} {c}" for c in classes) + ". Undecided is not "
             "level: two undecided comparisons say nothing about the models agreeing; only `equivalent` on both "
             "(the interval inside the study's margin on each) says a cell is within the margin of full cache on "
             "both.", ""]
    for name in classes:
        members = evicting[evicting["across_models"] == name]
        if members.empty:
            continue
        listed = ", ".join(f"{r['policy']} {r['budget']} ({r['a_verdict']} / {r['b_verdict']})"
                           for _, r in members.iterrows())
        lines.append(f"- {name} ({len(members)}): {listed}")
    return lines + ["", f"(verdicts as `{name_a} / {name_b}`)", ""]


def orders_lines(found: list[Order], name_a: str, name_b: str) -> list[str]:
    table = pd.DataFrame([{"budget": o.budget, "policies": o.policies,
                           "Kendall's tau-b (95% interval)": "undefined" if o.tau != o.tau else
                           f"{o.tau:+.2f} ({o.low:+.2f}, {o.high:+.2f})",
                           "interval": o.reading} for o in found])
    drawn = [o for o in found if o.resamples]
    undefined = sum(o.undefined for o in drawn)
    note = (f"Resamples: {', '.join(f'{o.budget} {o.resamples:,}' for o in drawn)}; the bounds' Monte Carlo "
            f"standard error at most {max(o.mc_error for o in drawn):.3g} (target below {TAU_TARGET}, so that "
            f"{4 * TAU_TARGET:g} is four of them; at most {MAX_RESAMPLES:,} resamples)"
            + (f"; {undefined} resample(s) tied every policy on a model (tau undefined) and are left out"
               if undefined else "") + "." if drawn else "")
    return [f"Kendall's tau-b between the cell averages of {name_a} and {name_b} at each budget (the evicting "
            "policies; full cache left out), with 95% BCa intervals from a paired bootstrap: each task's sample ids "
            "drawn with replacement, the same ids for both models and every cell, each cell's average recomputed "
            "as the study's `average` (the mean of the task means) and tau from them; the acceleration from a "
            "jackknife over samples; draws from a generator seeded by a hash of the scores themselves "
            f"(`stats.data_seed`), {RESAMPLES:,} at first, doubled until both bounds' Monte Carlo standard error "
            f"(from {SECTIONS} sections of the draws) is below {TAU_TARGET}. Ranks in the cell table: 1 is the "
            "highest average at its budget.", "", table.to_markdown(index=False), "", note, ""]


def to_markdown(a: StudyRuns, b: StudyRuns, frame: pd.DataFrame, found: list[Order], command: str) -> str:
    name_a, name_b = side_names(a, b)
    parts = [f"# {a.root} ({a.model}) beside {b.root} ({b.model})", "",
             design_line(a, b, frame, found, name_a, name_b), "", f"Produced by `{command}`", ""]
    for data in sorted(frame["data"].unique()):
        part = frame[frame["data"] == data]
        margins = f"{a.margin:g} and {b.margin:g}" if a.margin != b.margin else f"{a.margin:g}"
        parts += [f"## {data}", "",
                  f"Per cell, each model's average score (0-100, the mean of the task scores) with its 95% BCa "
                  f"interval, and its paired difference from full cache (same samples) with the 95% interval that "
                  f"inverts its sign-flip test, the p-value Holm-adjusted over that study's own family (`*` below "
                  f"{SIGNIFICANCE}, `+` Benjamini-Hochberg only, `?` unsettled) and its verdict at the study's margin "
                  f"of {margins} points (`harness.analysis.verdicts`), all as each study's own summary gives them. "
                  f"{name_a}: {a.source}; {name_b}: {b.source}.", "",
                  markdown_table(cells_table(part, name_a, name_b)), "",
                  "### Which comparisons decide the same way", "",
                  *classification_lines(part, name_a, name_b),
                  "### The order of policies", "",
                  *orders_lines([o for o in found if o.data == data], name_a, name_b)]
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------- the picture
def plot(frame: pd.DataFrame, found: list[Order], out: Path, name_a: str, name_b: str) -> list[Path]:
    """Each cell's average on one model against the other, both 95% intervals drawn, one panel per
    (data, budget), full cache in every panel; the diagonal is equal averages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.analysis.plots import _save, color

    panels = [(o.data, o.budget, o) for o in found]
    columns = min(4, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns + 1.6, 3.8 * rows), squeeze=False)
    full = frame[frame["policy"] == "full"].set_index("data")
    span = (min(frame["a_average_low"].min(), frame["b_average_low"].min()) - 2,
            max(frame["a_average_high"].max(), frame["b_average_high"].max()) + 2)
    legend = {}
    for index, (ax, (data, budget, order)) in enumerate(zip(axes.flat, panels)):
        shown = frame[(frame["data"] == data) & (frame["budget"] == budget)]
        for _, row in pd.concat([full.loc[[data]].reset_index(), shown]).iterrows():
            legend[row["policy"]] = ax.errorbar(
                row["a_average"], row["b_average"], fmt="*" if row["policy"] == "full" else "o",
                xerr=[[row["a_average"] - row["a_average_low"]], [row["a_average_high"] - row["a_average"]]],
                yerr=[[row["b_average"] - row["b_average_low"]], [row["b_average_high"] - row["b_average"]]],
                color=color(row["policy"]), capsize=2)
        ax.axline((0, 0), slope=1, linestyle=":", color="grey", lw=1)  # equal averages on both models
        ax.set_xlim(span)
        ax.set_ylim(span)
        ax.set_aspect("equal")
        tau = "undefined" if order.tau != order.tau else f"{order.tau:+.2f} ({order.low:+.2f}, {order.high:+.2f})"
        ax.set_title(f"{data} {budget}\ntau {tau}", fontsize=9)
        ax.set_xlabel(textwrap.fill(f"{name_a} average", 28), fontsize=8)
        if index % columns == 0:
            ax.set_ylabel(textwrap.fill(f"{name_b} average", 28), fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.legend(list(legend.values()), list(legend), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.suptitle("Average score per cell (0-100) on both models, 95% intervals", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "cross_model")


def compare_studies(root_a: Path, root_b: Path, **options) -> tuple[StudyRuns, StudyRuns, pd.DataFrame, list[Order]]:
    a, b = read_study(root_a), read_study(root_b)
    refuse_unless_comparable(a, b)
    return a, b, cells_frame(a, b), orders(a, b, **options)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study_a", type=Path, help="a study's folder on one model (results/<study>)")
    parser.add_argument("study_b", type=Path, help="the same study's folder on the other model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    try:
        a, b, frame, found = compare_studies(args.study_a, args.study_b)
    except Refused as refusal:
        print(f"cross_model: {refusal}", file=sys.stderr)
        return 2
    command = "python -m harness.analysis.cross_model " + " ".join(argv)
    markdown = to_markdown(a, b, frame, found, command)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "summary.md", markdown)
    atomic_write_text(args.out / "summary.csv", frame.to_csv(index=False))
    atomic_write_text(args.out / "orders.csv", orders_frame(found).to_csv(index=False))
    if not args.no_plots:
        plot(frame, found, args.out, *side_names(a, b))
    print(markdown)
    print(f"[cross_model] {len(frame)} cells, {len(found)} orders -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

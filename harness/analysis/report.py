"""``results/RESULTS.md``: what the committed results say, written from their summaries, never typed.

    python -m harness.analysis.report            # (re)writes results/RESULTS.md
    python -m harness.analysis.report --check    # exit 1 when results/RESULTS.md is not what the summaries give

Accuracy studies (``ACCURACY``): from each folder's ``summary.csv`` (``harness.analysis.aggregate``), for
each model and dataset, PagedEviction (the study's ``focus`` variant) minus every other variant at
each budget or compression ratio and minus full cache, on the average over tasks of every
quantity the runs recorded (task score; where present answer log-likelihood, top-1 agreement and
KL to full cache), with the 95% interval that inverts the comparison's sign-flip test and the
table-wide Holm adjustment ``summary.md`` marks; then how many of those comparisons are decided
either way.

Throughput settings (``THROUGHPUT``): from each ``results/throughput/<setting>/summary.csv``, every
cell's ratio of output tok/s against the setting's baseline cell of the same trial: the geometric
mean over trials with a 95% t-interval (``harness.analysis.stats.ratio_interval``) where there are at least
two trials, the single ratio otherwise (said so), and the eviction and query-capture shares of step
time; for the prefill setting (``reconstruction``), prefill seconds against full cache's and the
share of them KVzip's reconstruction passes took.

Every section names the code versions its cells ran at (``harness.records.provenance.code_version``; the
commit for results older than it): a table is comparable with another only at one code version,
and the last section says how many there are. ``tests/experiments/test_claims.py`` checks that
the committed RESULTS.md is this module's output and that every number ``docs/results.md`` (its Results section) and
``results/FINDINGS.md`` quote appears here, beside the comparison it belongs to, taken the way
round its sentence says (``direction``), that every "N of M decided" count is of the
comparisons its sentence describes (``miscounted``), and that a code version or a count of trials
named in prose is one of the results its paragraph names (``misdated``).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from harness.analysis.aggregate import QUANTITIES, SIGNIFICANCE, Quantity, group_scores, settled
from harness.analysis.labels import budget_label, signed as signed_text
from harness.analysis.silence import dead_samples
from harness.records.results import atomic_write_text, read_json
from harness.analysis.stats import MAX_FLIPS, ratio_interval
from harness.analysis.studies import THROUGHPUT_MARGIN, Study, accuracy_studies, throughput_settings
from harness.analysis.verdicts import ACROSS_MODELS, trials_verdict, verdict as verdict_of

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path("results")
OUT = RESULTS / "RESULTS.md"
COMMAND = "python -m harness.analysis.report"


# The studies, from their one table (``harness.analysis.studies``).
ACCURACY = accuracy_studies()
THROUGHPUT = throughput_settings()


def short(commit: str | None) -> str:
    if not commit:
        return "unknown"
    return commit[:8] + ("+dirty" if commit.endswith("+dirty") else "")


def version_of(provenance: dict | None) -> str:
    """The code version a result ran at (``harness.records.provenance.code_version``); results made before
    code versions were recorded are named by their commit."""
    provenance = provenance or {}
    if provenance.get("code_version"):
        return "code " + provenance["code_version"]
    return "commit " + short(provenance.get("git_commit"))


def commits_text(commits: list[str]) -> str:
    counts = pd.Series(commits).value_counts()
    return ", ".join(f"{commit} ({n} cell{'s' if n > 1 else ''})" for commit, n in sorted(counts.items()))


def interval_text(value: float, low: float, high: float, decimals: int, signed: bool = True) -> str:
    """``value (low, high)``; signed, a non-zero bound that would print as zero gets the places that
    show its side (``harness.analysis.labels.signed``)."""
    if signed:
        return f"{signed_text(value, decimals)} ({signed_text(low, decimals)}, {signed_text(high, decimals)})"
    return f"{value:.{decimals}f} ({low:.{decimals}f}, {high:.{decimals}f})"


def mark(p_holm: float) -> str:
    return " *" if p_holm < SIGNIFICANCE else ""


# ---------------------------------------------------------------- accuracy
def run_version(run_dir: str, root: Path) -> str:
    config = yaml.safe_load((root / run_dir / "config.yaml").read_text())
    return version_of(config.get("provenance"))


def budget_key(label: str) -> tuple:
    return (label.startswith("r"), float(label[1:]) if label.startswith("r") else int(label) if label.isdigit() else -1)


def versus_table(focus: pd.DataFrame, others: list[str], budgets: list[str], quantity: Quantity,
                 margin: float | None = None) -> tuple[list[str], dict[str, int]]:
    """Markdown rows of focus minus each other variant (columns: budgets), each with its verdict
    (``harness.analysis.verdicts``; ``margin``: the study's, for its primary signal), and the counts."""
    counts = {"higher": 0, "lower": 0, "undecided": 0, "unsettled": 0, "equivalent": 0, "non-inferior": 0}
    better = {"higher": "better", "lower": "worse"} if quantity.higher_is_better else {"higher": "worse", "lower": "better"}
    lines = ["| focus minus | " + " | ".join(budgets) + " |", "|---|" + "---|" * len(budgets)]
    for other in others:
        cells = []
        for budget in budgets:
            stem = quantity.versus(other, average=True)
            row = focus.loc[budget] if budget in focus.index else None
            if row is None or f"{stem}_diff" not in row or row[f"{stem}_diff"] != row[f"{stem}_diff"]:
                cells.append("")
                continue
            p_holm = row[f"{stem}_p_holm"]
            word = verdict_of(row[f"{stem}_diff"], row[f"{stem}_low"], row[f"{stem}_high"], p_holm, margin,
                           higher_is_better=quantity.higher_is_better, settled=settled(row, stem))
            if word in ("equivalent", "non-inferior"):
                counts[word] += 1
            if not settled(row, stem):  # at the threshold within Monte Carlo error: no mark either way
                cells.append(interval_text(row[f"{stem}_diff"], row[f"{stem}_low"], row[f"{stem}_high"],
                                           quantity.decimals) + f" ? {word}")
                counts["undecided"] += 1
                counts["unsettled"] += 1
                continue
            cells.append(interval_text(row[f"{stem}_diff"], row[f"{stem}_low"], row[f"{stem}_high"],
                                       quantity.decimals) + mark(p_holm) + f" {word}")
            if p_holm < SIGNIFICANCE:
                counts["higher" if row[f"{stem}_diff"] > 0 else "lower"] += 1
            else:
                counts["undecided"] += 1
        if any(cells):
            lines.append(f"| {other} | " + " | ".join(cells) + " |")
    verdict = {better[k]: v for k, v in counts.items() if k in better}
    return lines, {**verdict, "undecided": counts["undecided"], "unsettled": counts["unsettled"],
                   "equivalent": counts["equivalent"], "non-inferior": counts["non-inferior"]}


def accuracy_section(study: Study, root: Path) -> list[str]:
    folder = root / RESULTS / study.folder
    frame = read_summary(folder)
    parts = [f"### {study.title}", "",
             f"`results/{study.folder}/` (its `summary.md` has every table); cells by `{study.made_by}`.", ""]
    for (model, data), group in frame.groupby(["model.name", "data.name"], sort=True):
        runs = group.drop_duplicates("run_dir").copy()
        runs["label"] = [budget_label(row) for _, row in runs.iterrows()]
        if study.focus not in set(runs["variant"]):
            continue
        tasks = sorted(group["task"].unique())
        samples = group.groupby("task")["samples"].first()
        focus = runs[runs["variant"] == study.focus].set_index("label")
        budgets = sorted(focus.index, key=budget_key)
        others = ["full"] + sorted(v for v in runs["variant"].unique() if v not in ("full", study.focus))
        parts += [f"**{model} on {data}**: {len(tasks)} tasks, {int(samples.min())}"
                  + (f"-{int(samples.max())}" if samples.max() != samples.min() else "")
                  + f" samples per task, {len(runs)} cells; ran at: "
                  + commits_text([run_version(r, root) for r in runs["run_dir"]]) + ". " + silence_line(group, root), ""]
        parts += kvzip_note(runs["variant"])
        full = runs[runs["variant"] == "full"]
        for quantity in QUANTITIES:
            average = quantity.average_column
            if average not in runs or runs[average].isna().any():
                continue
            direction = "higher is better" if quantity.higher_is_better else "lower is better"
            margin = study.margin if quantity.field == study.primary else None
            table, verdict = versus_table(focus, others, budgets, quantity, margin)
            decided = verdict["better"] + verdict["worse"]
            total = decided + verdict["undecided"]
            family = family_size(runs, quantity)
            role = "primary signal" if quantity.field == study.primary else "secondary signal"
            stated = (f"verdicts at the study's margin of {margin:g} {quantity.unit} (`equivalent`: the interval inside "
                      f"-+{margin:g}; `non-inferior`: its lower bound above -{margin:g}; `inconclusive`: neither, nor "
                      "decided)" if margin is not None else "no margin for a secondary signal: `better`, `worse` or "
                      "`inconclusive`")
            parts += [f"*{quantity.description}* ({role}; {quantity.units}, average over tasks; {direction}): "
                      f"`{study.focus}` minus each; marks adjusted over the table's {family} comparisons; {stated}.", ""]
            if len(full) and average in full:
                reference = full.iloc[0]
                parts += ["Full cache: " + interval_text(reference[average], reference[f"{average}_low"],
                                                         reference[f"{average}_high"], quantity.decimals,
                                                         signed=False) + ".", ""]
            parts += table + [""]
            parts += [f"Decided after Holm: {decided} of {total} (`{study.focus}` better in {verdict['better']}, "
                      f"worse in {verdict['worse']}); undecided: {verdict['undecided']}"
                      + (f" ({verdict['unsettled']} of them `?`)" if verdict["unsettled"] else "")
                      + (f", of which equivalent at the margin: {verdict['equivalent']}, non-inferior: "
                         f"{verdict['non-inferior']}, inconclusive: "
                         f"{verdict['undecided'] - verdict['equivalent'] - verdict['non-inferior']}"
                         if margin is not None else "") + ".", ""]
            if "compress=context" in study.focus:  # the leaderboard's own question: against its own loop alone
                scope = decided_counts(study, root, quantity, SCOPES[0][1])
                parts += [f"Of these, against the other variants compressing the context alone: {scope[0]} of "
                          f"{scope[1]} decided (`{study.focus}` better in {scope[2]}).", ""]
    return parts + across_models_lines(study, root)


def across_models_lines(study: Study, root: Path) -> list[str]:
    """Where a study repeats another on a second model (``Study.across``): how its comparisons against
    full cache decide on the two models, and how alike the two orders of policies are per budget, from
    ``<folder>/across_models`` (``harness.analysis.cross_model``, which has the cell table)."""
    folder = root / RESULTS / study.folder / "across_models"
    if study.across is None or not all((folder / name).exists() for name in ("summary.csv", "orders.csv")):
        return []  # not compared yet (or not to the end: cross_model writes summary.csv first)
    cells = pd.read_csv(folder / "summary.csv")
    orders = pd.read_csv(folder / "orders.csv")
    evicting = cells[cells["policy"] != "full"]
    model_a, model_b = cells["a_model"].iloc[0], cells["b_model"].iloc[0]
    counts = evicting["across_models"].value_counts()
    classes = [name.format(a=model_a, b=model_b) for name in ACROSS_MODELS]
    parts = [f"**Across models**: `results/{study.folder}/across_models/summary.md` sets these cells beside "
             f"`results/{study.across}/` ({model_a}), cell by cell. Of the {len(evicting)} comparisons against full "
             "cache (each model's own verdict, Holm over its own family): "
             + ", ".join(f"{int(counts.get(name, 0))} {name}" for name in classes)
             + ". Kendall's tau-b between the two models' cell averages of the evicting policies at each budget "
             f"({model_a} against {model_b}; 95% BCa interval from a paired bootstrap over samples):", "",
             "| data | budget | policies | tau-b (95% interval) |", "|---|---|---|---|"]
    for row in orders.itertuples():
        tau = "undefined" if pd.isna(row.kendall_tau) else (
            f"{row.kendall_tau:+.2f} ({row.low:+.2f}, {row.high:+.2f})")
        parts.append(f"| {row.data} | {row.budget} | {row.policies} | {tau} |")
    return parts + [""]


# KVzip's numbers are those of one allocation (issue 65): the engine keeps an equal count per (layer,
# KV head), the authors' `pair-uniform` level, not KVzip's default single threshold over layers and heads
KVZIP_NAMED = ("`kvzip` is KVzip (pair-uniform): an equal count kept per layer and KV head, the authors' "
               "`pair-uniform` level, not KVzip's default single threshold over layers and heads "
               "(docs/policies.md, docs/design_kvzip.md).")


def kvzip_note(variants) -> list[str]:
    return [KVZIP_NAMED, ""] if any(str(v).startswith("kvzip") for v in variants) else []


def silence_line(group: pd.DataFrame, root: Path) -> str:
    """How many of the table's samples score 0 in every cell (``harness.analysis.silence``), on the
    tasks its rows keep (a view without a task, ``--drop-task``, counts without it)."""
    dead = dead_samples(group_scores(group, root))
    return (f"{dead.dead_total} of {dead.total} samples score 0 in every cell ({dead.per_task_text(dead_only=True)}); "
            "its summary also scores the cells without them.")


def family_size(runs: pd.DataFrame, quantity: Quantity) -> int:
    """How many distinct comparisons of the average the table adjusts over (each pair once)."""
    pairs = set()
    for _, run in runs[runs["policy.name"] != "full"].iterrows():
        for column in run.index:
            prefix = quantity.versus("", average=True)
            if column.startswith(prefix) and column.endswith("_p_holm") and run[column] == run[column]:
                other = column[len(prefix):-len("_p_holm")]
                other_label = "all" if other == "full" else run["label"]
                pairs.add(frozenset([(run["variant"], run["label"]), (other, other_label)]))
    return len(pairs)


# ---------------------------------------------------------------- throughput
def throughput_section(setting: str, root: Path) -> list[str]:
    """A setting's cells as ratios over its baseline, per configuration over its trials. A prefill
    setting (``experiments/throughput.py reconstruction``) states prefill seconds over full cache's
    (higher is slower) and the reconstruction passes' share of them, not output tok/s."""
    folder = root / RESULTS / "throughput" / setting
    frame = read_summary(folder)
    if "trial" not in frame:
        frame["trial"] = 1
    frame["base"] = frame["cell"].str.replace(r" #\d+$", "", regex=True)
    prefill = "x_baseline" not in frame
    ratio_column = "x_full" if prefill else "x_baseline"
    baseline = frame.loc[frame[ratio_column] == 1.0, "base"].iloc[0]
    commits = [version_of(read_json(path).get("provenance")) for path in sorted((folder / "cells").glob("*.json"))]
    trials = int(frame["trial"].max())
    shares = (("reconstruct % of prefill", "reconstruct_share"),) if prefill else (
        ("evict % of step", "evict_share"), ("capture % of step", "capture_share"))
    measure = "prefill s, " if prefill else ""
    parts = [f"### `{setting}`", "",
             f"`results/throughput/{setting}/summary.md` (workload and command there); {len(frame)} cells, "
             f"up to {trials} trial{'s' if trials > 1 else ''}; ran at: {commits_text(commits)}.", "",
             f"| cell | trials | {measure}x {baseline} (95% t-interval) | verdict at {1 - THROUGHPUT_MARGIN:g}x | "
             + " | ".join(h for h, _ in shares) + " |",
             "|---|---|---|---|" + "---|" * len(shares)]
    for base, cells in frame.groupby("base", sort=False):
        ratios = cells[ratio_column].astype(float).tolist()
        word = "-"
        if base == baseline:
            ratio = "1 (baseline)"
        else:  # prefill seconds: lower is better; output tok/s: higher
            word = trials_verdict(ratios, higher_is_better=not prefill)
            if len(ratios) >= 2:
                interval = ratio_interval(ratios)
                ratio = f"{interval.estimate:.2f} ({interval.low:.2f}, {interval.high:.2f})"
            else:
                ratio = f"{ratios[0]:.2f} (one trial: no interval)"
        parts.append(f"| {base} | {len(ratios)} | {ratio} | {word} | "
                     + " | ".join(percent(cells, c) for _, c in shares) + " |")
    return parts + [""] + kvzip_note(frame["base"])


def percent(cells: pd.DataFrame, column: str) -> str:
    """A share of step time (a fraction in summary.csv) as a percentage, the mean over trials; "-"
    where the cell does not measure it (stock vLLM has no eviction clock)."""
    if column not in cells or cells[column].isna().all():
        return "-"
    return f"{100 * cells[column].mean():.2f}"


# ---------------------------------------------------------------- the document
def present(studies: tuple[Study, ...], root: Path) -> list[Study]:
    """The studies with a committed summary (a study not run yet, or retired, is left out)."""
    return [study for study in studies if (root / RESULTS / study.folder / "summary.csv").exists()]


def present_settings(root: Path) -> list[str]:
    return [s for s in THROUGHPUT if (root / RESULTS / "throughput" / s / "summary.csv").exists()]



def read_summary(folder: Path) -> pd.DataFrame:
    """A study's ``summary.csv``, read whole: a column such as ``_p_settled`` holds flags beside
    blanks, which pandas' chunked reading would type differently chunk by chunk (with a warning)."""
    return pd.read_csv(folder / "summary.csv", low_memory=False)


def code_versions(root: Path) -> list[str]:
    found: dict[str, set[str]] = {}
    for study in present(ACCURACY, root):
        frame = read_summary(root / RESULTS / study.folder)
        for run_dir in frame["run_dir"].unique():
            found.setdefault(run_version(run_dir, root), set()).add(study.folder)
    for setting in present_settings(root):
        for path in (root / RESULTS / "throughput" / setting / "cells").glob("*.json"):
            found.setdefault(version_of(read_json(path).get("provenance")), set()).add(f"throughput/{setting}")
    lines = ["## Code versions", "",
             f"The cells above ran at {len(found)} code version{'s' if len(found) != 1 else ''} (a hash of what "
             "runs while a result is made, `harness.records.provenance.code_version`; results older than it are named "
             "by their commit): a comparison across studies at different versions compares code as well as "
             "policies.", ""]
    for commit in sorted(found):
        lines.append(f"- {commit}: {', '.join(sorted(found[commit]))}")
    return lines + [""] + verified_lines(sorted({folder for folders in found.values() for folder in folders}), root)


def verified_lines(folders: list[str], root: Path) -> list[str]:
    """Where each study was verified by replay at a later code version (``experiments/regenerate.py
    --verify``, its ``verified.json``): what ran where, and what the replay compared."""
    records = [(folder, read_json(path)) for folder in folders
               if (path := root / RESULTS / folder / "verified.json").exists()]
    if not records:
        return []
    lines = ["Verified by replay at a later code version (`python experiments/regenerate.py --verify`: a fixed, "
             "stratified subset of each study's cells rerun at that code and compared with the committed outputs):", ""]
    for folder, record in records:
        replayed = record["replayed"]
        samples = sum(entry.get("samples", 0) for entry in replayed)
        subset = f"{len(replayed)} of {record['cells']} cells" + (f", {samples} samples" if samples else "")
        moved = sum(len(entry["moved"]) for entry in replayed)
        verdict = "equal" if record["verdict"] == "verified" else f"{moved} outputs moved"
        lines.append(f"- {folder}: ran at {', '.join(record['ran_at'])}; replayed at {record['code_version']} "
                     f"(commit {short(record['git_commit'])}, {record['date']}): {subset}, {verdict}; compared: "
                     f"{record['compared']}")
    return lines + [""]


def serving_sections(root: Path) -> list[str]:
    """Each serving sweep's verdict (``results/serving/<workload>/summary.md``'s "## Verdict",
    ``harness.serving.summary.headline``) under its workload's name, with the command that made it."""
    found = sorted((root / "results" / "serving").glob("*/summary.md"))
    if not found:
        return []
    parts = ["## Serving", "",
             "`vllm serve` with the eviction scheduler loaded by vLLM's own `benchmark()` (docs/serving_bench.md); "
             "ratios against full cache with prefix caching in the same trial and rate, 95% t-intervals over trials.", ""]
    for path in found:
        text = path.read_text()
        command = next((line for line in text.splitlines() if line.startswith("Command: ")), "")
        verdict = section(text, "## Verdict").split("\n", 1)[1]
        parts += [f"### `{path.parent.name}`", "",
                  f"From [{path.relative_to(root).as_posix()}]({path.relative_to(root / 'results').as_posix()}). "
                  + command, "", verdict.strip(), ""]
        parts += kvzip_note(["kvzip"] if "kvzip" in verdict else [])
        record = path.parent / "verified.json"
        if record.exists():  # experiments/serving.py --verify (harness.serving.experiment.verify)
            record = read_json(record)
            replayed = record["replayed"]
            outcome = ("nothing moved" if record["verdict"] == "verified"
                       else f"{len(record['moved'])} moved: {'; '.join(record['moved'][:3])}")
            parts += [f"Verified at code version {record['code_version']} (commit {short(record['git_commit'])}, "
                      f"{record['date']}; the sweep ran at {record['ran_at']}) by `{record['command']}`: the "
                      f"summaries recomputed from the saved runs and {len(replayed)} requests replayed alone, "
                      f"{sum(entry['equal'] for entry in replayed)} of them the committed text; {outcome}.", ""]
    return parts


def render(root: Path = ROOT) -> str:
    parts = ["# Results", "",
             f"Written by `{COMMAND}` from the committed summaries: rerun their commands to change it, never edit "
             "it (`tests/experiments/test_claims.py` fails when it differs from what they give). "
             "Intervals are 95%: for an accuracy difference the shifts its own paired, stratified sign-flip test does "
             "not reject (so it excludes zero exactly when the unadjusted p < 0.05), for a cell's score BCa bootstrap over "
             "samples, t over trials for throughput ratios. "
             f"`*`: Holm-adjusted p < {SIGNIFICANCE:g}, adjusted over each table's whole family of comparisons; an "
             "unmarked difference is undecided, not absent. Each study declares one primary signal (the task "
             "score); Holm adjusts within a table and a signal, never across signals, so a verdict on a secondary "
             "signal is a lead for another study, not a finding of this one. "
             "`?`: a comparison whose Holm or Benjamini-Hochberg decision is still unsettled after the Monte Carlo "
             f"refinement (random sign patterns up to {MAX_FLIPS:,}), given no mark and counted undecided. "
             "In words: [FINDINGS.md](FINDINGS.md).", "",
             "## Accuracy", ""]
    for study in present(ACCURACY, root):
        parts += accuracy_section(study, root)
    parts += ["## Throughput", "",
              "Output tok/s of each cell over the setting's baseline cell of the same trial (trials: an "
              "engine process per cell, the trial's cells back to back). Verdict against the baseline at a margin of "
              f"{THROUGHPUT_MARGIN:.0%} (`harness.analysis.studies.THROUGHPUT_MARGIN`): `better`/`worse` where the "
              f"interval excludes 1, `equivalent` where it lies inside ({1 - THROUGHPUT_MARGIN:g}x, "
              f"{1 / (1 - THROUGHPUT_MARGIN):.3g}x), `non-inferior` where its worse-side bound lies inside that, else "
              "`inconclusive`; unadjusted over a setting's cells.", ""]
    for setting in present_settings(root):
        parts += throughput_section(setting, root)
    parts += serving_sections(root)
    parts += code_versions(root)
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------- quoted numbers
# What the documents may quote only from a summary: every decimal number outside code spans and
# link targets (identifiers such as `Llama-3.1-8B` or `vllm 0.32` go in code spans), and every
# "N of M" count. Integers elsewhere are budgets, sample sizes and names, not findings. A ratio
# may carry its "x" (1.65x, and the range 0.89x-0.95x): the number is read without it, and found
# in a summary that writes it either way (``appears``).
CHECKED_DOCUMENTS = {"docs/results.md": None, "results/FINDINGS.md": None}  # None: the whole file, a heading: its section
# Whose words must not claim more than the verdicts (``unbacked_claims``).
WORDED_DOCUMENTS = {"results/FINDINGS.md": None, "README.md": "## What it shows"}
_CODE = re.compile(r"`[^`]*`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
# Not after a letter and a hyphen (Llama-3.1), unless that letter is a ratio's x (0.89x-0.95x).
_DECIMAL = re.compile(r"(?<![\w.])(?<!(?<![\d.])[A-Za-z]-)[-+]?\d+\.\d+(?![\w.]*\d)")
# After a number, what makes it part of a longer token: a letter or digit (other than a ratio's
# closing x), or a further decimal part.
_NOT_ITS_END = r"(?!(?!x\b)\w|\.\d)"
_COUNT = re.compile(r"\b\d+ of \d+\b")
_NAMED = re.compile(r"results/[\w./-]+")


def section(text: str, heading: str | None) -> str:
    """The part of a Markdown document under ``heading`` (to the next heading of its level)."""
    if heading is None:
        return text
    level = heading.split()[0]
    start = text.index("\n" + heading + "\n") + 1
    end = text.find("\n" + level + " ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def sources_of(paragraph: str, root: Path) -> str:
    """RESULTS.md and every summary the paragraph names (a results/ path: a .md file itself, a
    folder its summary.md and sample_size.md)."""
    texts = [(root / OUT).read_text()]
    for name in _NAMED.findall(paragraph):
        path = root / name.rstrip(".,;:")
        candidates = [path] if path.suffix == ".md" else [path / "summary.md", path / "sample_size.md"]
        texts += [c.read_text() for c in candidates if c.is_file()]
    return "\n".join(texts)


def quoted(paragraph: str) -> list[str]:
    """The numbers a paragraph quotes as findings (``CHECKED_DOCUMENTS``' rule): none in code, a
    `span` or a block of commands (every line indented four spaces: options and versions)."""
    if all(line.startswith(("    ", "\t")) for line in paragraph.strip("\n").splitlines()):
        return []
    prose = _LINK_TARGET.sub("]", _CODE.sub("", paragraph))
    return _DECIMAL.findall(prose) + _COUNT.findall(prose)


def appears(number: str, source: str) -> bool:
    """``number`` is in ``source`` as a number of its own: with its sign if it has one, with any
    sign (or none) if it has none; a ratio's trailing x (``0.92x``) ends it like a space would."""
    body = re.escape(number.lstrip("+-"))
    sign = re.escape(number[0]) if number[0] in "+-" else "[-+]?"
    return re.search(rf"(?<![\w.]){sign}{body}{_NOT_ITS_END}", source) is not None


def unsupported(text: str, root: Path = ROOT) -> list[str]:
    """Each quoted number of ``text`` that neither RESULTS.md nor the summaries its paragraph (or
    its section's heading) names contain, as ``number: paragraph start``."""
    found = []
    heading = ""  # a paragraph also reads the summaries its section's heading names
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("#"):
            heading = paragraph
        numbers = quoted(paragraph)
        if not numbers:
            continue
        source = sources_of(heading + "\n" + paragraph, root)
        found += [f"{n}: {paragraph.strip()[:70]!r}" for n in numbers if not appears(n, source)]
        # An interval is one claim: its three numbers together, not each somewhere (a table of
        # hundreds of comparisons holds most small numbers by chance).
        printed_triples = interval_values(source)
        found += [f"{m.group(1)}: {paragraph.strip()[:70]!r}" for m in _TRIPLE.finditer(paragraph)
                  if all(appears(n, source) for n in m.groups()) and interval_key(m) not in printed_triples]
    return found


def interval_key(match: re.Match) -> tuple[float, float, float]:
    return tuple(float(value) for value in match.groups())


def interval_values(source: str) -> set[tuple[float, float, float]]:
    """Every interval "E (L, H)" ``source`` prints, as numbers."""
    return {interval_key(m) for m in _TRIPLE.finditer(source)}


# ---------------------------------------------------------------- numbers on the right comparison
# A number can be in a summary and still be quoted for the wrong comparison (SnapKV's difference
# written beside KeyDiff's name). Where a sentence says which comparison it means, that can be
# checked: an interval "E (L, H)" quoted as an accuracy study's difference or cell average must
# belong to a comparison whose other policy is the one the sentence names last before it (its name
# in prose, or its variant in a code span) and, where the sentence names budgets before it, at the
# budget (or among the list of budgets) named last. A sentence that names no policy before its
# interval says nothing this can check.
PROSE_NAMES = {  # a policy's name in prose -> its registry name
    "full cache": "full", "PagedEviction": "paged", "SnapKV": "snapkv", "H2O": "h2o", "TOVA": "tova",
    "StreamingLLM": "streaming", "KeyDiff": "keydiff", "Knorm": "knorm", "key norm": "knorm", "LRU": "lru",
    "value norm": "value_norm", "learned scorer": "learned", "learned score": "learned", "hybrid": "hybrid",
    "recency": "recency",
}
_TRIPLE = re.compile(r"(?<![\w.])([-+]?\d+\.\d+) \(([-+]?\d+\.\d+), ([-+]?\d+\.\d+)\)")
_SENTENCE = re.compile(r"(?<=[.;!?])\s+(?=[A-Z(])")
_LIST_JOINER = re.compile(r"^(,\s*|\s+and\s+|,\s+and\s+|\s+or\s+)$")  # between listed names


@dataclass(frozen=True)
class Quoted:
    """What an interval in an accuracy summary is: a cell's average (``other`` is None) or the
    study focus minus ``other``, of ``variant`` at ``budget`` (a budget label; "all" for full cache)."""
    study: str
    quantity: str
    variant: str
    budget: str
    other: str | None
    values: tuple[float, float, float]


def base_name(variant: str) -> str:
    return variant.split("[", 1)[0]


def study_cells(study: Study, root: Path) -> pd.DataFrame:
    """An accuracy study's cells: its summary.csv, one row per run."""
    return read_summary(root / RESULTS / study.folder).drop_duplicates("run_dir")


def study_intervals(study: Study, root: Path, frame: pd.DataFrame | None = None) -> list[Quoted]:
    """Every interval an accuracy study's summaries print: each cell's average and the focus's
    paired differences, per quantity, as printed (``Quantity.decimals``). ``frame``: its cells
    (``study_cells``), if already read."""
    frame = study_cells(study, root) if frame is None else frame
    found = []
    for _, run in frame.iterrows():
        label = budget_label(run)
        for quantity in QUANTITIES:
            average = quantity.average_column
            if average in run and run[average] == run[average]:
                found.append(Quoted(study.folder, quantity.field, run["variant"], label, None, tuple(
                    round(float(run[c]), quantity.decimals) for c in (average, f"{average}_low", f"{average}_high"))))
            if run["variant"] != study.focus:
                continue
            prefix = quantity.versus("", average=True)
            for column in run.index:
                if column.startswith(prefix) and column.endswith("_diff") and run[column] == run[column]:
                    stem = column[:-len("_diff")]
                    found.append(Quoted(study.folder, quantity.field, run["variant"], label, stem[len(prefix):], tuple(
                        round(float(run[f"{stem}_{part}"]), quantity.decimals) for part in ("diff", "low", "high"))))
    return found


@dataclass(frozen=True)
class Printed:
    """What the accuracy studies' summaries print, read once: per study folder its intervals
    (``study_intervals``) and focus, and the budget labels a sentence can name (``budget_words``)."""
    intervals: dict[str, list[Quoted]]
    focus: dict[str, str]
    budgets: frozenset[str]


def budget_words(cells: list[pd.DataFrame]) -> frozenset[str]:
    """The budget labels the studies' cells have ("256", "r0.5"; not full cache's "all"): what a
    sentence can name as a budget, so a study with new budgets needs no list edited."""
    return frozenset(budget_label(run) for frame in cells for _, run in frame.iterrows()) - {"all"}


def printed(root: Path = ROOT) -> Printed:
    """Every present accuracy study's summary.csv, read once (``Printed``)."""
    studies = present(ACCURACY, root)
    cells = {study.folder: study_cells(study, root) for study in studies}
    return Printed({study.folder: study_intervals(study, root, cells[study.folder]) for study in studies},
                   {study.folder: study.focus for study in studies}, budget_words(list(cells.values())))


def matches(values: tuple[float, float, float], quoted: Quoted) -> bool:
    """The interval as the summary prints it, or taken the other way round (the other minus the
    focus: every number negated, the bounds swapped)."""
    estimate, low, high = quoted.values
    return values in ((estimate, low, high), (-estimate, -high, -low))


def misattributed(text: str, root: Path = ROOT, summaries: Printed | None = None) -> list[str]:
    """Each interval of ``text`` quoted as an accuracy study's number (``study_intervals``) beside a
    policy or budget that none of the comparisons printing it has, as ``interval: sentence start``.
    ``summaries``: the studies' summaries (``printed``), if already read."""
    found, heading = [], ""
    summaries = summaries or printed(root)
    intervals, focus = summaries.intervals, summaries.focus
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("#"):
            heading = paragraph
        named = {name.rstrip(".,;:") for name in _NAMED.findall(heading + "\n" + paragraph)}
        folders = [f for f in intervals if any(n == f"results/{f}" or n.startswith(f"results/{f}/") for n in named)]
        for sentence in _SENTENCE.split(" ".join(paragraph.split())):
            sentence = _LINK_TARGET.sub("]", sentence)  # the offsets below are of this text
            for triple in _TRIPLE.finditer(sentence):
                values = tuple(float(v) for v in triple.groups())
                candidates = [q for f in folders for q in intervals[f] if matches(values, q)]
                prefix, suffix = sentence[:triple.start()], sentence[triple.end():]
                verdicts = [consistent(q, prefix, suffix, focus[q.study], summaries.budgets, values) for q in candidates]
                if False in verdicts and True not in verdicts:
                    found.append(f"{triple.group(0)} is {describe(candidates)}, not what its sentence names: "
                                 f"{sentence.strip()[:90]!r}")
    return found


def mentions_in(prefix: str, variants: set[str]) -> list[tuple[int, int, str]]:
    """The policies ``prefix`` names, in order, as (start, end, registry name or variant): a variant
    in a code span, or a prose name of its policy (``PROSE_NAMES``)."""
    mentions = [(span.start(), span.end(), span.group(0).strip("`")) for span in _CODE.finditer(prefix)
                if span.group(0).strip("`") in variants]
    prose = _CODE.sub(lambda m: " " * len(m.group(0)), prefix)
    for name, policy in PROSE_NAMES.items():
        for found in re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", prose, flags=re.IGNORECASE if " " in name else 0):
            mentions.append((found.start(), found.end(), policy))
    return sorted(mentions)


def last_group(prefix: str, found: list[tuple[int, int, str]]) -> set[str]:
    """The last name of ``found`` with the names listed right before it ("KeyDiff and TOVA",
    "256, 512 and 1024"): a sentence that lists several gives each its number in turn."""
    group = {found[-1][2]}
    for earlier, later in zip(reversed(found[:-1]), reversed(found[1:])):
        if not _LIST_JOINER.match(prefix[earlier[1]:later[0]]):
            break
        group.add(earlier[2])
    return group


def budgets_named(prefix: str, suffix: str, budgets: frozenset[str]) -> set[str] | None:
    """The budget an interval is given for: the one right after it ("(...) at `r0.5`"), else the
    budget (or list of budgets) its clause names last before it; None if it names none.
    ``budgets``: the labels a sentence can name (``budget_words``)."""
    pattern = "|".join(sorted((re.escape(b) for b in budgets), key=len, reverse=True))
    after = re.match(rf"\s*(?:points |nats |times full cache )?at (?:budget )?`?({pattern})`?(?![\w]|\.\d)", suffix)
    if after:
        return {after.group(1)}
    found = [(m.start(), m.end(), m.group(1)) for m in re.finditer(rf"(?<![\w.])`?({pattern})`?(?![\w]|\.\d)", prefix)]
    return last_group(prefix, found) if found else None


def consistent(quoted: Quoted, prefix: str, suffix: str, focus: str, budgets: frozenset[str],
               values: tuple[float, float, float] | None = None) -> bool | None:
    """Whether the sentence names ``quoted``'s policy last before it (for a difference: the other
    policy, the focus's own name aside), if it names a budget for it (one of ``budgets``),
    ``quoted``'s, and, where it says which way the difference is taken (``direction``), whether
    ``values`` are printed that way; None when it names no such policy (nothing to check)."""
    if values is not None and quoted.other is not None and values != (0.0, 0.0, 0.0):
        expected = direction(prefix, base_name(focus), base_name(quoted.other))
        taken = "printed" if values == quoted.values else "negated"
        if expected is not None and expected != taken:
            return False
    names = {quoted.variant, focus} | ({quoted.other} if quoted.other else set())
    mentions = mentions_in(prefix, names)
    if quoted.other is not None:
        mentions = [m for m in mentions if m[2] not in (focus, base_name(focus))]
    if not mentions:
        return None
    wanted = quoted.other or quoted.variant
    if not last_group(prefix, mentions) & {wanted, base_name(wanted)}:
        return False
    named = budgets_named(re.split(r"[;:]", prefix)[-1], suffix, budgets)  # a budget named in this clause
    return named is None or quoted.budget in named or quoted.budget == "all"


# A sentence that says which way a difference is taken: "A minus B", or A "ahead of", "above",
# "behind", "below", "better than" or "worse than" B. Its last such phrase before a quoted
# difference decides: "PagedEviction stays ahead of SnapKV ... (x)" quotes PagedEviction minus
# SnapKV, so x must be printed that way round, not as SnapKV minus PagedEviction (issue 51: a
# sentence quoted the reverse difference, and the check, which accepted either way, passed it).
_DIRECTION = re.compile(r"\bminus\b|\b(?:ahead of|above|behind|below|better than|worse than)\b")


def direction(prefix: str, focus: str, other: str) -> str | None:
    """"printed" when the sentence's last direction phrase before the number takes the focus minus
    ``other`` (the way the summaries print it), "negated" when it takes ``other`` minus the focus,
    None when it has no such phrase or it names another pair (registry names, as ``base_name``)."""
    phrases = list(_DIRECTION.finditer(prefix))
    if not phrases:
        return None
    phrase = phrases[-1]
    mentions = mentions_in(prefix, set())
    before = [m for m in mentions if m[1] <= phrase.start()]
    after = [m for m in mentions if m[0] >= phrase.end()]
    if not before or not after:
        return None  # "KeyDiff is ahead: x" names one side only
    first, second = base_name(before[-1][2]), base_name(after[0][2])
    if (first, second) == (focus, other):
        return "printed"
    if (first, second) == (other, focus):
        return "negated"
    return None


# ---------------------------------------------------------------- "N of M decided" counts
# A count of decided comparisons must be of the comparisons its sentence describes (issue 51:
# "Against the other policies compressing the context alone, 15 of 56 comparisons are decided"
# counted the whole table, full cache and the whole-prompt cells included; of the context-only
# policies alone it was 6 of 24). The count is recomputed from the study's summary.csv for the
# scope the sentence names and the quantity it speaks of.
_DECIDED = re.compile(r"\b(?:decides?|decided:?)\s+(\d+) of (\d+)\b|\b(\d+) of (\d+)(?: comparisons)?(?: are)? decided\b")
_BETTER = re.compile(r"(?:PagedEviction better in (\d+))|(?:(\d+) (?:with PagedEviction )?better and (\d+) worse)")
QUANTITY_WORDS = (("log-likelihood", "answer_logprob"), ("likelihood", "answer_logprob"), ("agreement", "top1_agreement"),
                  ("KL", "kl_to_full"), ("task score", "score"))
SCOPES = (  # (words in the sentence before the count, which other variants it counts)
    ("compressing the context alone", lambda variant: "compress=context" in variant and variant != "full"),
    ("against full cache", lambda variant: variant == "full"),
    ("other policies", lambda variant: variant != "full"),
)


def decided_counts(study: Study, root: Path, quantity: Quantity, counts) -> tuple[int, int, int]:
    """(decided, comparisons, decided with the focus better) over the focus's comparisons of the
    average whose other variant ``counts`` accepts, as RESULTS.md counts them."""
    frame = study_cells(study, root)
    focus = frame[frame["variant"] == study.focus]
    decided = total = better = 0
    prefix = quantity.versus("", average=True)
    for _, run in focus.iterrows():
        for column in run.index:
            if not (column.startswith(prefix) and column.endswith("_p_holm")) or run[column] != run[column]:
                continue
            stem = column[:-len("_p_holm")]
            if not counts(stem[len(prefix):]):
                continue
            total += 1
            if run[column] < SIGNIFICANCE and settled(run, stem):
                decided += 1
                better += (run[f"{stem}_diff"] > 0) == quantity.higher_is_better
    return decided, total, better


def miscounted(text: str, root: Path = ROOT) -> list[str]:
    """Each "N of M decided" of ``text`` (with "PagedEviction better in B" where given) that no
    accuracy study its paragraph names gives for the scope and quantity its sentence names."""
    found, heading = [], ""
    studies = present(ACCURACY, root)
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("#"):
            heading = paragraph
        named = {name.rstrip(".,;:") for name in _NAMED.findall(heading + "\n" + paragraph)}
        mine = [s for s in studies if any(n == f"results/{s.folder}" or n.startswith(f"results/{s.folder}/") for n in named)]
        if not mine:
            continue
        flat = " ".join(paragraph.split())
        for sentence in _SENTENCE.split(flat):
            for match in _DECIDED.finditer(sentence):
                n, m = (int(g) for g in (match.group(1, 2) if match.group(1) else match.group(3, 4)))
                before, after = sentence[:match.start()], sentence[match.end():]
                better = _BETTER.match(after.lstrip(" ,:(")) if after else None
                b = None if better is None else int(better.group(1) or better.group(2))
                words = [(before.rfind(word), field) for word, field in QUANTITY_WORDS if word in before]
                field = max(words)[1] if words else "score"
                quantity = next(q for q in QUANTITIES if q.field == field)
                scope = next((counts for words, counts in SCOPES if words in before), lambda variant: True)
                truths = [decided_counts(s, root, quantity, scope) for s in mine]
                if not any((n, m) == t[:2] and b in (None, t[2]) for t in truths):
                    found.append(f"{match.group(0)}{'' if b is None else f' ({b} better)'} is not what "
                                 f"{', '.join(s.folder for s in mine)} give for its scope ({field}: "
                                 + "; ".join(f"{d} of {t}, {g} better" for d, t, g in truths) + f"): {sentence[:90]!r}")
    return found


def describe(candidates: list[Quoted]) -> str:
    first = candidates[0]
    what = (f"{first.variant} minus {first.other}" if first.other else f"{first.variant}'s average")
    more = f" (or {len(candidates) - 1} more)" if len(candidates) > 1 else ""
    return f"{first.study} {first.quantity}: {what} at {first.budget}{more}"


# ---------------------------------------------------------------- words the verdicts must back
# Issue 65, item 1: prose that calls a comparison level, alike or "no more than" another, or says
# one "does not beat" another, claims equivalence or non-inferiority; undecided is not that. Such a
# sentence passes only where it names the verdict ("equivalent", "non-inferior") and quotes an
# interval that gives it at the margin of a study its paragraph names (``Study.margin``):
# equivalent inside -+margin, non-inferior with a bound inside it. Also caught: a causal "is what
# lifts" with no direct test, a superlative over a table ("scores lowest"), a replay called equal
# without saying how many cells of how many, dead samples said to be "all" of one kind, and a design
# that cannot decide reported as finding no difference.
_LEVEL_WORDS = re.compile(
    r"\b(?:are|is|were|was|stays?|stayed|runs?|ran|scores?|scored|comes? out|came out)\s+(?:about |roughly |essentially )?level\b"
    r"|\blevel with\b|\bon (?:a )?par\b|\balike\b|\bas good as\b|\bindistinguishable\b|\bkeeps? up with\b"
    r"|\bno (?:more|less|better|worse)\b[^.;]*?\bthan\b|\b(?:does|do|did) not beat\b|\bdoesn't beat\b|\bnever beats?\b"
    r"|\b(?:does|do|did) not (?:differ|part|separate)\b|\bas it did not\b|\bno difference (?:between|from|to)\b",
    flags=re.IGNORECASE)
_OTHER_CLAIMS = (
    (re.compile(r"\bis what (?:lifts|makes|drives|causes|buys|costs|lowers|raises)\b", re.IGNORECASE),
     "a causal claim with no direct test"),
    (re.compile(r"\b(?:scores?|scored|ranks?|is|are)\s+(?:the\s+)?(?:lowest|highest|best|worst)\b", re.IGNORECASE),
     "a superlative over a table: it needs every comparison decided"),
    (re.compile(r"\breplayed (?:equal|identically|the same)\b", re.IGNORECASE),
     "a replay called equal without how many cells of how many"),
    (re.compile(r"\b(?:dead|score 0)\b[^.]*\ball of them\b", re.IGNORECASE),
     "dead samples said to be all of one kind"),
)
_UNDECIDABLE = re.compile(r"\bno difference is decided\b|\bnothing (?:is|was) decided\b|\bnone (?:is|are) decided\b",
                          re.IGNORECASE)


def margin_of(paragraph_names: set[str]) -> float:
    """The margin of the first study a paragraph names, else the default (points of score)."""
    from harness.analysis.studies import DEFAULT_MARGIN, STUDIES

    for study in STUDIES:
        if any(n == f"results/{study.folder}" or n.startswith(f"results/{study.folder}/") for n in paragraph_names):
            return study.margin
    return DEFAULT_MARGIN


def backed(sentence: str, margin: float) -> bool:
    """Whether a sentence names an equivalence or non-inferiority verdict and quotes an interval
    that gives it at ``margin``."""
    triples = [tuple(float(v) for v in m.groups()) for m in _TRIPLE.finditer(sentence)]
    if re.search(r"\bequivalent\b", sentence) and any(-margin < low and high < margin for _, low, high in triples):
        return True
    return bool(re.search(r"\bnon-inferior\b", sentence)) and any(
        low > -margin or high < margin for _, low, high in triples)


def undecidable_folders(root: Path) -> set[str]:
    """Folders of results whose comparisons.csv families (``part``) cannot decide anything under
    Holm (``harness.analysis.stats.can_decide``, from each comparison's clusters)."""
    from harness.analysis.stats import can_decide

    found = set()
    for path in sorted((root / RESULTS).glob("*/comparisons.csv")):
        frame = pd.read_csv(path)
        if "clusters" not in frame or "part" not in frame:
            continue
        if any(not can_decide([int(c) for c in family["clusters"]], SIGNIFICANCE) for _, family in frame.groupby("part")):
            found.add(path.parent.relative_to(root).as_posix())
    return found


def unbacked_claims(text: str, root: Path = ROOT) -> list[str]:
    """Sentences of ``text`` whose words claim more than the verdicts give (see above)."""
    found, heading = [], ""
    cannot = undecidable_folders(root)
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("#"):
            heading = paragraph
        named = {name.rstrip(".,;:") for name in _NAMED.findall(heading + "\n" + paragraph)}
        margin = margin_of(named)
        flat = " ".join(_CODE.sub(lambda m: " " * len(m.group(0)), paragraph).split())
        for sentence in _SENTENCE.split(flat):
            original = sentence
            level = _LEVEL_WORDS.search(sentence)
            if level and re.search(r"\b(?:not|nor|neither|nothing|never)\b[^,;:]{0,40}$", sentence[:level.start()]) and not \
                    re.match(r"(?i)no |does|do |did|doesn|never|as it", level.group(0)):
                level = None  # "says nothing about the two being alike", "undecided is not level": the rule itself
            if level and not backed(original, margin):
                found.append(f"{level.group(0)!r} with no equivalence or non-inferiority verdict at the margin "
                             f"({margin:g}) behind it: {original.strip()[:100]!r}")
            for pattern, what in _OTHER_CLAIMS:
                claim = pattern.search(sentence)
                if claim and not (what.startswith("a replay") and re.search(r"\b\d+ of \d+\b", sentence)):
                    found.append(f"{claim.group(0)!r}, {what}: {original.strip()[:100]!r}")
            if _UNDECIDABLE.search(sentence) and any(n == f"results/{f.split('/', 1)[1]}" or
                                                    n.startswith(f"results/{f.split('/', 1)[1]}/")
                                                    for n in named for f in cannot):
                found.append(f"a design that cannot decide reported as a finding: {original.strip()[:100]!r}")
    return found


# Provenance named in prose (issue 65: FINDINGS named code versions and a trial count that were not
# those of the cells): a code version must be one the named results record, a count of trials one of
# theirs.
_CODE_NAMED = re.compile(r"\bcode(?: version)? ([0-9a-f]{12})\b")
_TRIALS_NAMED = re.compile(r"\b(two|three|four|five|six|seven|eight|nine|ten|\d+) trials\b", re.IGNORECASE)
_NUMBER_WORDS = {word: n for n, word in enumerate(
    ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"))}
_RECORDED_VERSION = re.compile(r"code_version\"?:\s*\"?([0-9a-f]{12})")


def named_folder(name: str, root: Path) -> Path | None:
    """The results folder a name in prose points at (a summary's folder for a file), if it exists."""
    path = root / name
    folder = path if path.is_dir() else path.parent
    return folder if folder.is_dir() and folder != root / RESULTS else None


def recorded_versions(folder: Path) -> set[str]:
    """Every code version a results folder's records name: its cells' config.yaml and cell records,
    its run and provenance records, verified.json (files of a megabyte or more are outputs, not records)."""
    found = set()
    for path in folder.rglob("*"):
        if path.suffix in (".json", ".yaml") and path.is_file() and path.stat().st_size < 2**20:
            found.update(_RECORDED_VERSION.findall(path.read_text(errors="ignore")))
    return found


def trials_of(folder: Path) -> int | None:
    """How many trials a throughput setting or a serving sweep ran (None where a folder has no trials)."""
    if (folder / "cells").is_dir():
        numbers = [int(m.group(1)) for cell in (folder / "cells").glob("*.json")
                   for m in [re.search(r"__trial-(\d+)\.json$", cell.name)] if m]
        return max(numbers, default=1)
    settings = folder / "settings.json"
    if settings.is_file():
        import json

        return json.loads(settings.read_text()).get("trials")
    return None


def misdated(text: str, root: Path = ROOT) -> list[str]:
    """Sentences naming a code version that none of the results their paragraph names records, or a
    number of trials none of them ran (a sentence about an "earlier run" is about results no longer
    committed, and is not checked)."""
    found, heading, versions, trials = [], "", {}, {}
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("#"):
            heading = paragraph
        folders = {folder for name in _NAMED.findall(heading + "\n" + paragraph)
                   for folder in [named_folder(name.rstrip(".,;:"), root)] if folder is not None}
        if not folders:
            continue
        flat = " ".join(paragraph.split())
        for sentence in _SENTENCE.split(flat):
            if re.search(r"\b(?:earlier|previous) run\b", sentence):
                continue  # a run the committed results replaced, said to be one
            for version in _CODE_NAMED.findall(sentence):
                known = set().union(*(versions.setdefault(f, recorded_versions(f)) for f in folders))
                if known and version not in known:
                    found.append(f"code version {version}, which no result its paragraph names records: "
                                 f"{sentence.strip()[:100]!r}")
            for count in _TRIALS_NAMED.findall(sentence):
                ran = {t for f in folders for t in [trials.setdefault(f, trials_of(f))] if t}
                number = _NUMBER_WORDS.get(count.lower(), None if not count.isdigit() else int(count))
                if ran and number not in ran:
                    found.append(f"{count} trials, where the results its paragraph names ran "
                                 f"{' or '.join(map(str, sorted(ran)))}: {sentence.strip()[:100]!r}")
    return found


def check_documents(root: Path = ROOT) -> list[str]:
    """What ``CHECKED_DOCUMENTS`` quote that no summary backs (``unsupported``) or that sits beside
    the wrong comparison (``misattributed``), the accuracy summaries read once for all of them."""
    problems = []
    summaries = printed(root)
    for name, heading in CHECKED_DOCUMENTS.items():
        text = section((root / name).read_text(), heading)
        problems += [f"{name}: quoted but in no summary: {line}" for line in unsupported(text, root)]
        problems += [f"{name}: on the wrong comparison: {line}" for line in misattributed(text, root, summaries)]
        problems += [f"{name}: miscounted: {line}" for line in miscounted(text, root)]
    for name, heading in WORDED_DOCUMENTS.items():
        text = section((root / name).read_text(), heading)
        problems += [f"{name}: {line}" for line in unbacked_claims(text, root)]
        problems += [f"{name}: {line}" for line in misdated(text, root)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    args = parser.parse_args(argv)
    text = render(ROOT)
    target = ROOT / OUT
    if args.check:
        if not target.exists() or target.read_text() != text:
            print(f"{OUT} is not what the summaries give: run `{COMMAND}`", file=sys.stderr)
            return 1
        problems = check_documents(ROOT)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            return 1
        print(f"{OUT} matches the summaries; every number {', '.join(CHECKED_DOCUMENTS)} quote is in one, "
              "every interval beside the comparison it belongs to and taken its sentence's way round, every count "
              "of decided comparisons of the ones it describes, every code version and count of trials named one "
              "of the results its paragraph names")
        return 0
    atomic_write_text(target, text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

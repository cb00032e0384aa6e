"""``results/RESULTS.md``: what the committed results say, written from their summaries, never typed.

    python -m harness.analysis.report            # (re)writes results/RESULTS.md
    python -m harness.analysis.report --check    # exit 1 when results/RESULTS.md is not what the summaries give

Accuracy studies (``ACCURACY``): from each folder's ``summary.csv`` (``harness.analysis.aggregate``), for
each model and dataset, PagedEviction (the study's ``focus`` variant) minus every other variant at
each budget or compression ratio and minus full cache, on the average over tasks of every
quantity the runs recorded (task score; where present answer log-likelihood, top-1 agreement and
KL to full cache), with the 95% BCa interval and the table-wide Holm adjustment ``summary.md``
marks; then how many of those comparisons are decided either way.

Throughput settings (``THROUGHPUT``): from each ``results/throughput/<setting>/summary.csv``, every
cell's ratio of output tok/s against the setting's baseline cell of the same trial: the geometric
mean over trials with a 95% t-interval (``harness.analysis.stats.ratio_interval``) where there are at least
two trials, the single ratio otherwise (said so), and the eviction and query-capture shares of step
time.

Every section names the code versions its cells ran at (``harness.records.provenance.code_version``; the
commit for results older than it): a table is comparable with another only at one code version,
and the last section says how many there are. ``tests/experiments/test_claims.py`` checks that
the committed RESULTS.md is this module's output and that every number the README and
``results/FINDINGS.md`` quote appears here.
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

from harness.analysis.aggregate import QUANTITIES, SIGNIFICANCE, Quantity
from harness.analysis.labels import budget_label
from harness.records.results import atomic_write_text, read_json
from harness.analysis.stats import ratio_interval

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path("results")
OUT = RESULTS / "RESULTS.md"
COMMAND = "python -m harness.analysis.report"


@dataclass(frozen=True)
class AccuracyStudy:
    folder: str
    title: str
    made_by: str  # the sweep that wrote the cells (the aggregate command is in summary.md)
    focus: str  # the variant every other is compared with


ACCURACY = (
    AccuracyStudy("cpu_accuracy", "The policies on the embedded suite",
                  "python run.py -m +experiment=cpu_accuracy", "paged"),
    AccuracyStudy("ruler", "RULER at kvpress's compression ratios (prompt only)",
                  "python experiments/regenerate.py --only ruler", "paged[decode_eviction=False]"),
    AccuracyStudy("ablation", "PagedEviction's score and granularity apart",
                  "python run.py -m +experiment=ablation", "paged"),
)
THROUGHPUT = ("quick", "cpu", "cpu_tight", "attention", "overhead", "latency", "shared_prefix", "tensor_parallel")


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
    sign = "+" if signed else ""
    return f"{value:{sign}.{decimals}f} ({low:{sign}.{decimals}f}, {high:{sign}.{decimals}f})"


def mark(p_holm: float) -> str:
    return " *" if p_holm < SIGNIFICANCE else ""


# ---------------------------------------------------------------- accuracy
def run_version(run_dir: str, root: Path) -> str:
    config = yaml.safe_load((root / run_dir / "config.yaml").read_text())
    return version_of(config.get("provenance"))


def budget_key(label: str) -> tuple:
    return (label.startswith("r"), float(label[1:]) if label.startswith("r") else int(label) if label.isdigit() else -1)


def versus_table(focus: pd.DataFrame, others: list[str], budgets: list[str], quantity: Quantity
                 ) -> tuple[list[str], dict[str, int]]:
    """Markdown rows of focus minus each other variant (columns: budgets), and the verdict counts."""
    counts = {"higher": 0, "lower": 0, "undecided": 0}
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
            cells.append(interval_text(row[f"{stem}_diff"], row[f"{stem}_low"], row[f"{stem}_high"],
                                       quantity.decimals) + mark(p_holm))
            if p_holm < SIGNIFICANCE:
                counts["higher" if row[f"{stem}_diff"] > 0 else "lower"] += 1
            else:
                counts["undecided"] += 1
        if any(cells):
            lines.append(f"| {other} | " + " | ".join(cells) + " |")
    verdict = {better[k]: v for k, v in counts.items() if k != "undecided"}
    return lines, {**verdict, "undecided": counts["undecided"]}


def accuracy_section(study: AccuracyStudy, root: Path) -> list[str]:
    folder = root / RESULTS / study.folder
    frame = pd.read_csv(folder / "summary.csv")
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
                  + commits_text([run_version(r, root) for r in runs["run_dir"]]) + ".", ""]
        full = runs[runs["variant"] == "full"]
        for quantity in QUANTITIES:
            average = quantity.average_column
            if average not in runs or runs[average].isna().any():
                continue
            direction = "higher is better" if quantity.higher_is_better else "lower is better"
            table, verdict = versus_table(focus, others, budgets, quantity)
            decided = sum(v for k, v in verdict.items() if k != "undecided")
            total = decided + verdict["undecided"]
            family = family_size(runs, quantity)
            parts += [f"*{quantity.description}* ({quantity.units}, average over tasks; {direction}): "
                      f"`{study.focus}` minus each, 95% BCa interval; `*` Holm-adjusted p < {SIGNIFICANCE:g} "
                      f"over the table's {family} comparisons.", ""]
            if len(full) and average in full:
                reference = full.iloc[0]
                parts += ["Full cache: " + interval_text(reference[average], reference[f"{average}_low"],
                                                         reference[f"{average}_high"], quantity.decimals,
                                                         signed=False) + ".", ""]
            parts += table + [""]
            parts += [f"Decided after Holm: {decided} of {total} (`{study.focus}` better in {verdict['better']}, "
                      f"worse in {verdict['worse']}); undecided: {verdict['undecided']}.", ""]
    return parts


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
    folder = root / RESULTS / "throughput" / setting
    frame = pd.read_csv(folder / "summary.csv")
    if "trial" not in frame:
        frame["trial"] = 1
    frame["base"] = frame["cell"].str.replace(r" #\d+$", "", regex=True)
    baseline = frame.loc[frame["x_baseline"] == 1.0, "base"].iloc[0]
    commits = [version_of(read_json(path).get("provenance")) for path in sorted((folder / "cells").glob("*.json"))]
    trials = int(frame["trial"].max())
    parts = [f"### `{setting}`", "",
             f"`results/throughput/{setting}/summary.md` (workload and command there); {len(frame)} cells, "
             f"up to {trials} trial{'s' if trials > 1 else ''}; ran at: {commits_text(commits)}.", "",
             f"| cell | trials | x {baseline} (95% t-interval) | evict % of step | capture % of step |",
             "|---|---|---|---|---|"]
    for base, cells in frame.groupby("base", sort=False):
        ratios = cells["x_baseline"].astype(float).tolist()
        if base == baseline:
            ratio = "1 (baseline)"
        elif len(ratios) >= 2:
            interval = ratio_interval(ratios)
            ratio = f"{interval.estimate:.2f} ({interval.low:.2f}, {interval.high:.2f})"
        else:
            ratio = f"{ratios[0]:.2f} (one trial: no interval)"
        parts.append(f"| {base} | {len(ratios)} | {ratio} | {percent(cells, 'evict_share')} | "
                     f"{percent(cells, 'capture_share')} |")
    return parts + [""]


def percent(cells: pd.DataFrame, column: str) -> str:
    """A share of step time (a fraction in summary.csv) as a percentage, the mean over trials; "-"
    where the cell does not measure it (stock vLLM has no eviction clock)."""
    if column not in cells or cells[column].isna().all():
        return "-"
    return f"{100 * cells[column].mean():.2f}"


# ---------------------------------------------------------------- the document
def present(studies: tuple[AccuracyStudy, ...], root: Path) -> list[AccuracyStudy]:
    """The studies with a committed summary (a study not run yet, or retired, is left out)."""
    return [study for study in studies if (root / RESULTS / study.folder / "summary.csv").exists()]


def present_settings(root: Path) -> list[str]:
    return [s for s in THROUGHPUT if (root / RESULTS / "throughput" / s / "summary.csv").exists()]



def code_versions(root: Path) -> list[str]:
    found: dict[str, set[str]] = {}
    for study in present(ACCURACY, root):
        frame = pd.read_csv(root / RESULTS / study.folder / "summary.csv")
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


def render(root: Path = ROOT) -> str:
    parts = ["# Results", "",
             f"Written by `{COMMAND}` from the committed summaries; edit those (by rerunning their "
             "commands), never this file: `tests/experiments/test_claims.py` fails when it differs from what they give. "
             "Intervals are 95%: BCa bootstrap over samples for accuracy, t over trials for throughput "
             "ratios. Significance is marked only after Holm's adjustment over each table's whole family "
             f"of comparisons (`*`: adjusted p < {SIGNIFICANCE:g}); an unmarked difference is undecided, "
             "not absent. In words: [FINDINGS.md](FINDINGS.md).", "",
             "## Accuracy", ""]
    for study in present(ACCURACY, root):
        parts += accuracy_section(study, root)
    parts += ["## Throughput", "",
              "Output tok/s of each cell over the setting's baseline cell of the same trial (trials: an "
              "engine process per cell, the trial's cells back to back).", ""]
    for setting in present_settings(root):
        parts += throughput_section(setting, root)
    parts += code_versions(root)
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------- quoted numbers
# What the documents may quote only from a summary: every decimal number outside code spans and
# link targets (identifiers such as `Llama-3.1-8B` or `vllm 0.32` go in code spans), and every
# "N of M" count. Integers elsewhere are budgets, sample sizes and names, not findings. A ratio
# may carry its "x" (1.65x, and the range 0.89x-0.95x): the number is read without it, and found
# in a summary that writes it either way (``appears``).
CHECKED_DOCUMENTS = {"README.md": "## Results", "results/FINDINGS.md": None}  # None: the whole file
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
    """The numbers a paragraph quotes as findings (``CHECKED_DOCUMENTS``' rule)."""
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
    return found


def check_documents(root: Path = ROOT) -> list[str]:
    problems = []
    for name, heading in CHECKED_DOCUMENTS.items():
        problems += [f"{name}: {line}" for line in unsupported(section((root / name).read_text(), heading), root)]
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
            print(f"quoted but in no summary: {problem}", file=sys.stderr)
        if problems:
            return 1
        print(f"{OUT} matches the summaries; every number {', '.join(CHECKED_DOCUMENTS)} quote is in one")
        return 0
    atomic_write_text(target, text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

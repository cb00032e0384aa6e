"""Paired comparisons of configurations whose samples come in clusters (issue 51, item 2).

Where several samples share a context, a conversation or a generated document, their outcomes
move together: a context the model reads badly fails all its questions. Treating its questions as
independent samples overstates the evidence (``results/shared_context``'s 40 later questions come
from 8 contexts). Here each sample carries a cluster key; the sign-flip test negates a whole
cluster's differences together and the interval inverts that test
(``harness.analysis.stats.inverted_interval``), so both say what the clusters, not the samples,
support, and the interval excludes zero exactly when p < 0.05.

Input: rows as ``experiments/shared_context.py`` writes them to ``requests.jsonl`` (one per
request: ``configuration``, ``task``, ``question``, ``score`` and the cluster key, ``context``).
A sample is identified by (task, cluster, question); two configurations are compared on the
samples both have.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from harness.analysis.stats import (EXACT_UP_TO, LEVEL, SCALE, benjamini_hochberg, can_decide,
                                    fewest_units_to_decide, holm, inverted_interval, settled_p_values, smallest_p)
from harness.analysis.labels import signed
from harness.analysis.studies import DEFAULT_MARGIN
from harness.analysis.verdicts import verdict

SIGNIFICANCE = 1 - LEVEL
Rows = list[dict]


def per_task(rows: Rows, configuration: str, keep: Callable[[dict], bool], cluster: str
             ) -> dict[str, dict[tuple, tuple[float, str]]]:
    """Per task, each kept sample of ``configuration``: (cluster, question) -> (score, cluster)."""
    found: dict[str, dict[tuple, tuple[float, str]]] = {}
    for row in rows:
        if row["configuration"] == configuration and keep(row):
            found.setdefault(row["task"], {})[(row[cluster], row["question"])] = (float(row["score"]), str(row[cluster]))
    return found


def differences(rows: Rows, a: str, b: str, keep: Callable[[dict], bool], cluster: str
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per task, ``a`` minus ``b`` on the samples both have (in a fixed order), and their clusters."""
    mine, theirs = per_task(rows, a, keep, cluster), per_task(rows, b, keep, cluster)
    values, labels = {}, {}
    for task in sorted(set(mine) & set(theirs)):
        common = sorted(set(mine[task]) & set(theirs[task]), key=str)
        values[task] = np.array([mine[task][k][0] - theirs[task][k][0] for k in common])
        labels[task] = np.array([mine[task][k][1] for k in common])
    return values, labels


def compare(rows: Rows, pairs: list[tuple[str, str]], keep: Callable[[dict], bool], cluster: str = "context",
            scale: float = SCALE, score_range: tuple[float, float] = (0.0, 1.0),
            margin: float = DEFAULT_MARGIN) -> list[dict]:
    """One family: each pair's difference (x ``scale``), its interval and p-value with whole
    clusters flipped, and Holm and Benjamini-Hochberg over the family. ``score_range``: where a
    score lies; a difference lies within its width either way, and so does its interval.
    ``clusters_needed``: the plan for a design that could show the row non-inferior to the column
    within ``margin`` points (``sample_size.clusters_for_non_inferiority``), per task."""
    from harness.analysis.sample_size import clusters_for_non_inferiority

    width = score_range[1] - score_range[0]
    found = [(a, b, *differences(rows, a, b, keep, cluster)) for a, b in pairs]
    p_values = settled_p_values([d for *_, d, _ in found], SIGNIFICANCE, clusters=[c for *_, c in found])
    plain = [value.p for value in p_values]
    table = []
    for (a, b, d, labels), value, p_holm, p_bh in zip(found, p_values, holm(plain), benjamini_hochberg(plain)):
        interval = inverted_interval(d, value, scale=scale, clusters=labels, bounds=(-width, width))
        clusters = len({label for task in labels.values() for label in task})
        cluster_means = {task: np.array([d[task][labels[task] == label].mean() for label in np.unique(labels[task])])
                         for task in d}
        table.append({"row": a, "column": b, "diff": interval.estimate, "low": interval.low, "high": interval.high,
                      "mc": interval.mc_error, "p": value.p, "p_flips": value.flips, "p_settled": value.settled,
                      "p_holm": p_holm, "p_bh": p_bh, "samples": interval.samples, "clusters": clusters,
                      "clusters_needed": clusters_for_non_inferiority(cluster_means, margin, scale)})
    return table


def mark(entry: dict) -> str:
    """``*`` Holm-adjusted p < 0.05, ``+`` Benjamini-Hochberg only, ``?`` unsettled (as the summaries)."""
    if not entry["p_settled"]:
        return " ?"
    return " *" if entry["p_holm"] < SIGNIFICANCE else " +" if entry["p_bh"] < SIGNIFICANCE else ""


def decides(table: list[dict]) -> bool:
    """Whether Holm over this family can reject anything (``stats.can_decide`` of its clusters)."""
    return can_decide([int(entry["clusters"]) for entry in table], SIGNIFICANCE)


def section(families: dict[str, list[dict]], what_a_cluster_is: str, margin: float = DEFAULT_MARGIN) -> list[str]:
    """Markdown: whether the design can decide (first, where it cannot), what a cluster is and how
    many, the method, one table per family with each comparison's verdict at ``margin``."""
    undecidable = [name for name, table in families.items() if table and not decides(table)]
    first = ([f"**This design cannot decide** {', '.join(undecidable)}: with its clusters the smallest attainable p "
              "times the family size is not below 0.05, so Holm can reject nothing there whatever the data; those "
              "tables enter no verdict, and \"undecided\" there is a property of the design, not a finding.", ""]
             if undecidable else [])
    lines = ["## Paired differences, whole clusters flipped together", "", *first,
             f"A cluster is {what_a_cluster_is}. Samples of one cluster are not independent, so the two-sided "
             "paired sign-flip test negates a whole cluster's differences together (a cluster's value: its "
             "samples' differences, each weighted as in the mean over tasks of the task means), stratified by task "
             "(`harness.analysis.stats._Stratified`: the difference over its stratified standard error against the same "
             "statistic with the clusters' deviations from their task's mean sign-flipped), every pattern counted "
             f"where there are at most {EXACT_UP_TO} clusters; the 95% interval is the set of shifts "
             "that test does not reject (`harness.analysis.stats.inverted_interval`), so it excludes zero exactly "
             "when p < 0.05. Row minus column, points on the 0-100 scale; marks adjusted over each table's "
             "comparisons: `*` Holm p < 0.05, `+` Benjamini-Hochberg q < 0.05 but not Holm; unmarked: undecided, "
             f"which is not the same as level. Verdicts at a margin of {margin:g} points (`harness.analysis.verdicts`): "
             f"`better`/`worse` where Holm decides, `equivalent` where the interval lies inside -+{margin:g}, "
             f"`non-inferior` where its lower bound lies above -{margin:g}, else `inconclusive`; `no verdict` where "
             "the design cannot decide.", ""]
    for name, table in families.items():
        decided = sum(entry["p_holm"] < SIGNIFICANCE and entry["p_settled"] for entry in table)
        clusters = sorted({entry["clusters"] for entry in table})
        samples = sorted({entry["samples"] for entry in table})
        able = decides(table) if table else True
        smallest = min((smallest_p(int(entry["clusters"])) for entry in table), default=1.0)
        lines += [f"**{name}** ({'/'.join(map(str, samples))} samples in {'/'.join(map(str, clusters))} clusters; "
                  f"Holm over {len(table)} comparisons, {decided} of {len(table)} decided; smallest attainable p "
                  f"{smallest:.3g}, Holm's first step needs p < {SIGNIFICANCE / max(1, len(table)):.3g}: "
                  + ("can decide" if able else "cannot decide, no verdict") + "):", "",
                  "| row | minus | difference (95% interval) | p | verdict |", "|---|---|---|---|---|"]
        for entry in table:
            word = verdict(entry["diff"], entry["low"], entry["high"], entry["p_holm"], margin,
                           settled=bool(entry["p_settled"]), decidable=able)
            lines.append(f"| {entry['row']} | {entry['column']} | {signed(entry['diff'], 2)} ({signed(entry['low'], 2)}, "
                         f"{signed(entry['high'], 2)}) | p={entry['p']:.4g}{mark(entry)} | {word} |")
        lines += plan_lines(table, able, margin)
        lines.append("")
    return lines


def plan_lines(table: list[dict], able: bool, margin: float) -> list[str]:
    """The next design, planned from this one: how many clusters per comparison would let Holm
    decide at all where it cannot, and how many per task would show each row non-inferior to full
    cache within ``margin`` with 80% power were its true difference zero."""
    from harness.analysis.sample_size import POWER

    parts = []
    if not able:
        parts.append(f"{fewest_units_to_decide(len(table))} clusters per comparison would let Holm decide at all "
                     f"over {len(table)} comparisons")
    plans = [f"{entry['row']} {entry['clusters_needed']}" for entry in table
             if entry["column"] == "full" and entry.get("clusters_needed") is not None]
    if plans:
        parts.append(f"to show a configuration non-inferior to full cache within {margin:g} points with "
                     f"{POWER:.0%} power, were its true difference zero, would take per task: " + ", ".join(plans)
                     + " clusters (`harness.analysis.sample_size.clusters_for_non_inferiority`, from the spread of "
                     "these per-cluster differences; more where the true difference is below zero)")
    return ["", "Planning the next design: " + "; ".join(parts) + "."] if parts else []

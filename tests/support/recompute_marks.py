"""An independent recomputation of the committed Holm and BH marks (issue 37's check), sharing no
code with ``harness/``: it reads ``summary.csv`` only for which comparisons a table holds and
the marks it printed, and ``predictions.jsonl`` for the samples.

    .venv/bin/python tests/support/recompute_marks.py results/cpu_accuracy results/ruler results/ablation

p-values: every sign pattern counted (as sums of two halves' sums) when at most 40 samples differ; otherwise 10^5 random
patterns from numpy's default generator (seed 20261126), and 10^7 for every comparison whose
Holm- or BH-adjusted p falls between 0.02 and 0.1 after that. Holm and BH written out here. A
mark the summary prints as `?` (not settled by its own computation) is reported, not compared.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

FIELDS = {"score": "", "answer_logprob": "answer_logprob_", "top1_agreement": "top1_agreement_",
          "kl_to_full": "kl_to_full_"}
RNG = np.random.default_rng(20261126)
EXACT = 22  # differing samples up to which every sign pattern is counted
NEAR = (0.01, 0.2)  # adjusted p-values that get 10^7 flips


@functools.lru_cache(maxsize=None)
def samples(run_dir: str, field: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in (Path(run_dir) / "predictions.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get(field) is not None:
            out.setdefault(row["task"], {})[row["id"]] = float(row[field])
    return out


def weighted_differences(a: dict, b: dict) -> np.ndarray:
    tasks = sorted(set(a) & set(b))
    parts = []
    for task in tasks:
        ids = sorted(set(a[task]) & set(b[task]))
        d = np.array([a[task][i] - b[task][i] for i in ids])
        parts.append(d[d != 0] / (len(ids) * len(tasks)))
    return np.concatenate(parts) if parts else np.zeros(0)


def p_value(w: np.ndarray, flips: int) -> float:
    observed = abs(w.sum())
    if observed == 0:
        return 1.0
    threshold = observed * (1 - 1e-9)
    if len(w) <= EXACT:  # exact: all 2^k sums, as the sums of two halves' sums
        def sums(part):
            out = np.zeros(1)
            for x in part:
                out = np.concatenate([out + x, out - x])
            return np.sort(out)
        left, right = sums(w[: len(w) // 2]), sums(w[len(w) // 2:])
        at_least = len(right) - np.searchsorted(right, threshold - left, side="left")
        at_most = np.searchsorted(right, -threshold - left, side="right")
        return float((at_least.sum() + at_most.sum()) / 2.0 ** len(w))
    # Random patterns 8 signs at a time: each random byte picks one of the 256 signed sums of a
    # group of 8 differences (zeros pad the last group), so a pattern's sum is k/8 look-ups.
    groups = -(-len(w) // 8)
    padded = np.zeros(8 * groups)
    padded[:len(w)] = w
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1
    tables = padded.reshape(groups, 8) @ (2.0 * bits - 1).T  # (groups, 256)
    hits = 0
    for start in range(0, flips, 1_000_000):
        n = min(1_000_000, flips - start)
        chosen = RNG.integers(0, 256, size=(groups, n), dtype=np.uint8)
        total = np.zeros(n)
        for group in range(groups):
            total += tables[group][chosen[group]]
        hits += int(np.count_nonzero(np.abs(total) >= threshold))
    return (1 + hits) / (1 + flips)


def holm(p: list[float]) -> np.ndarray:
    order, m, out, run = np.argsort(p, kind="stable"), len(p), np.empty(len(p)), 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (m - rank) * p[i]))
        out[i] = run
    return out


def bh(p: list[float]) -> np.ndarray:
    order, m, out, run = np.argsort(p, kind="stable"), len(p), np.empty(len(p)), 1.0
    for rank in range(m - 1, -1, -1):
        i = order[rank]
        run = min(run, p[i] * m / (rank + 1))
        out[i] = min(run, 1.0)
    return out


def label(row) -> str:
    ratio = row.get("budget_ratio")
    if ratio == ratio and ratio is not None:
        return f"r{ratio:g}"
    return "all" if row["policy.name"] == "full" else str(int(row["budget"]))


def study(folder: str) -> list[str]:
    frame = pd.read_csv(Path(folder) / "summary.csv", low_memory=False).drop_duplicates("run_dir")
    lines = []
    for field, prefix in FIELDS.items():
        runs = {(row["variant"], label(row)): row for _, row in frame.iterrows()}
        family = {}
        for (variant, budget), row in runs.items():
            for other_variant, other_budget in runs:
                stem = f"{prefix}avg_vs_{other_variant}"
                if (other_budget == budget or other_variant == "full") and (other_variant, other_budget) != (variant, budget) \
                        and f"{stem}_p" in row and row[f"{stem}_p"] == row[f"{stem}_p"]:
                    key = frozenset([(variant, budget), (other_variant, other_budget)])
                    family.setdefault(key, (row, stem, runs[(other_variant, other_budget)]))
        if not family:
            continue
        keys = list(family)
        values = {key: samples(family[key][0]["run_dir"], field) for key in keys}
        others = {key: samples(family[key][2]["run_dir"], field) for key in keys}
        weights = [weighted_differences(values[k], others[k]) for k in keys]
        p = [p_value(w, 100_000) for w in weights]
        escalated: set[int] = set()
        while True:  # until no adjusted p near 0.05 rests on fewer than 10^7 flips
            h, b = holm(p), bh(p)
            near = [i for i, w in enumerate(weights) if len(w) > EXACT and i not in escalated
                    and (NEAR[0] < h[i] < NEAR[1] or NEAR[0] < b[i] < NEAR[1])]
            if not near:
                break
            for i in near:
                p[i] = p_value(weights[i], 10_000_000)
                escalated.add(i)
        h, b = holm(p), bh(p)
        moved, unsettled = [], 0
        for i, key in enumerate(keys):
            row, stem, _ = family[key]
            committed_settled = row.get(f"{stem}_p_settled", True)
            if committed_settled is False or committed_settled == "False":
                unsettled += 1
                continue
            mine = "*" if h[i] < 0.05 else "+" if b[i] < 0.05 else ""
            theirs = "*" if row[f"{stem}_p_holm"] < 0.05 else "+" if row[f"{stem}_p_bh"] < 0.05 else ""
            if mine != theirs:
                moved.append(f"{sorted(key)}: committed {theirs or '-'}, recomputed {mine or '-'} (holm {h[i]:.4g})")
        lines.append(f"{folder} {field}: {len(keys)} comparisons, {len(keys) - unsettled - len(moved)} marks equal, "
                     f"{len(moved)} moved, {unsettled} committed as unsettled (?)")
        lines += ["  " + m for m in moved]
    return lines


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        for line in study(folder):
            print(line, flush=True)

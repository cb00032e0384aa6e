"""Fidelity to full cache: how much of the full-cache output a policy's output keeps.

Task scores of a small model can be low everywhere; fidelity still shows what eviction changed.
Per sample, against the full-cache prediction of the same sample: exact match, ROUGE-L F
(``rouge-score``'s rougeL, a similarity here, not LongBench's metric) and token F1.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import fmean

from harness.tasks.longbench.metrics import normalize_answer, token_f1


def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"])


def similarity(prediction: str, reference: str, scorer=None) -> dict:
    if prediction == reference:
        return {"exact_match": 1.0, "rougeL_f": 1.0, "token_f1": 1.0}
    scorer = scorer or _scorer()
    pred_tokens, ref_tokens = normalize_answer(prediction).split(), normalize_answer(reference).split()
    return {
        "exact_match": 0.0,
        "rougeL_f": scorer.score(reference, prediction)["rougeL"].fmeasure,
        "token_f1": token_f1(pred_tokens, ref_tokens) if pred_tokens and ref_tokens else 0.0,
    }


def fidelity(rows: list[dict], full_rows: list[dict]) -> dict | None:
    """Mean similarity per task and overall, over samples present in both runs (percent)."""
    reference = {(r["task"], r["id"]): r["prediction"] for r in full_rows}
    scorer = _scorer()
    per_task: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        key = (row["task"], row["id"])
        if key in reference:
            per_task[row["task"]].append(similarity(row["prediction"], reference[key], scorer))
    if not per_task:
        return None

    def mean_of(items: list[dict]) -> dict:
        return {k: round(100 * fmean(i[k] for i in items), 2) for k in ("exact_match", "rougeL_f", "token_f1")}

    everything = [item for items in per_task.values() for item in items]
    return {
        "samples": len(everything),
        **mean_of(everything),
        "tasks": {task: mean_of(items) for task, items in per_task.items()},
        "definition": "similarity to the full-cache prediction of the same sample, percent",
    }

"""A run's ``scores.json``: per-task scores, LongBench-E buckets, a labelled average.

Each task is scored by the metric its task spec names (``harness.tasks.task_spec``): LongBench's
for LongBench tasks, RULER's string match for RULER tasks and the embedded key retrieval. The same
function rescores a stored run from its ``predictions.jsonl`` (``python -m harness.scoring.rescore``).
"""
from __future__ import annotations

from collections import defaultdict

from harness.tasks import task_spec
from harness.tasks.metrics import score_sample, score_task, score_task_by_length

AVERAGE_LABEL = "average: unweighted mean of the task scores (LongBench itself prints none)"


def score_run(rows: list[dict], skipped: list[dict]) -> dict:
    by_task: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        row["score"] = score_sample(row["task"], row["prediction"], row["answers"], row.get("all_classes"))
        by_task[row["task"]].append(row)
    tasks = {}
    for task, task_rows in by_task.items():
        predictions = [r["prediction"] for r in task_rows]
        answers = [r["answers"] for r in task_rows]
        classes = task_rows[0].get("all_classes")
        entry = {
            "metric": task_spec(task).metric,
            "samples": len(task_rows),
            "score": score_task(task, predictions, answers, classes),
        }
        if task.endswith("_e"):
            entry["by_length"] = score_task_by_length(
                task, predictions, answers, [r["length"] for r in task_rows], classes
            )
        tasks[task] = entry
    skipped_by_task: dict[str, int] = defaultdict(int)
    for item in skipped:
        skipped_by_task[item["task"]] += 1
    return {
        "tasks": tasks,
        "average": round(sum(t["score"] for t in tasks.values()) / len(tasks), 2) if tasks else None,
        "average_definition": AVERAGE_LABEL,
        "samples": len(rows),
        "skipped": len(skipped),
        "skipped_by_task": dict(skipped_by_task),
        "skipped_samples": skipped,
    }

"""One sample's and one task's score under its family's rules: the metric its task spec names,
from the metrics every family registers (``harness.tasks.metric``), on the first line of the
prediction where the task scores only that (LongBench's few-shot tasks). Per task:
``round(100 * mean, 2)``, as LongBench prints it; LongBench-E also per length bucket."""
from __future__ import annotations

from typing import Sequence

from harness.tasks import metric, task_spec


def score_sample(task: str, prediction: str, answers: Sequence[str], all_classes=None) -> float:
    """One sample's score in [0, 1] under its benchmark's rules (LongBench's, RULER's)."""
    spec = task_spec(task)
    if spec.first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return metric(spec.metric)(prediction, answers, all_classes)


def score_task(task: str, predictions: Sequence[str], answers: Sequence[Sequence[str]], all_classes=None) -> float:
    """The task score as LongBench prints it: 0-100, two decimals."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    if not predictions:
        raise ValueError(f"no predictions to score for task {task!r}")
    total = sum(score_sample(task, p, a, all_classes) for p, a in zip(predictions, answers))
    return round(100 * total / len(predictions), 2)


def length_bucket(length: int) -> str:
    """LongBench-E's buckets by the record's ``length`` (words)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def score_task_by_length(task, predictions, answers, lengths, all_classes=None) -> dict[str, float]:
    """LongBench-E: the task score per length bucket (buckets with no sample are absent)."""
    buckets: dict[str, list[float]] = {}
    for prediction, answer_list, length in zip(predictions, answers, lengths):
        buckets.setdefault(length_bucket(length), []).append(score_sample(task, prediction, answer_list, all_classes))
    return {name: round(100 * sum(s) / len(s), 2) for name, s in sorted(buckets.items())}

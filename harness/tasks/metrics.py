"""LongBench v1's scoring, written from its published rules (THUDM/LongBench eval.py, metrics.py).

Per sample: the max over reference answers of the task's metric, in [0, 1]; few-shot tasks score
only the first line of the prediction. Per task: ``round(100 * mean, 2)``, as LongBench prints it.
ROUGE-L is the summary-level union-LCS of the ``rouge`` package (pltrdy 1.0.1) that LongBench
calls, not ``rouge-score``'s sentence-level rougeL; ``harness.tasks.longbench.rouge`` implements it.

RULER's set metrics (``string_match_all``, ``string_match_part``) live here too, so that one
``score_sample`` scores every task by the metric its spec names: RULER's tasks, and embedded tasks
whose question LongBench's metric would not score (key retrieval asks for a code, and a sentence
stating the code answers it; token F1 gives that sentence 0.25).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from difflib import SequenceMatcher
from typing import Callable, Sequence

from harness.tasks.spec import FIRST_LINE_TASKS, LONGBENCH_METRICS
from harness.tasks.longbench.rouge import rouge_l_summary

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop articles, collapse whitespace (SQuAD's normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def token_f1(prediction_tokens: Sequence[str], answer_tokens: Sequence[str]) -> float:
    overlap = sum((Counter(prediction_tokens) & Counter(answer_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(answer_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answer: str, all_classes=None) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(answer).split())


def rouge(prediction: str, answer: str, all_classes=None) -> float:
    return rouge_l_summary(prediction, answer)


def classification(prediction: str, answer: str, all_classes=None) -> float:
    matches = [name for name in all_classes or () if name in prediction]
    # LongBench removes "classes that are substrings of the answer but not the answer" while
    # iterating over the same list, which skips the element after each removal. The walk below
    # reproduces that exactly, so scores equal the official ones.
    index = 0
    while index < len(matches):
        term = matches[index]
        if term in answer and term != answer:
            matches.remove(term)
        index += 1
    return 1.0 / len(matches) if answer in matches else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, answer: str, all_classes=None) -> float:
    """Share of the numbers in the prediction that equal the answer's paragraph number."""
    target = re.findall(r"Paragraph (\d+)", answer)[0]
    return _share_equal(re.findall(r"\d+", prediction), target)


def count(prediction: str, answer: str, all_classes=None) -> float:
    return _share_equal(re.findall(r"\d+", prediction), str(answer))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` without python-Levenshtein: equal strings 100, an empty one 0,
    else difflib's ratio as a percent rounded the way Python's round() does (half to even)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * SequenceMatcher(None, a, b).ratio()))


def code_sim(prediction: str, answer: str, all_classes=None) -> float:
    """The first line that is not a comment or a fence, compared to the answer by fuzzy ratio."""
    line = next(
        (l for l in prediction.lstrip("\n").split("\n") if "`" not in l and "#" not in l and "//" not in l),
        "",
    )
    return fuzz_ratio(line, answer) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "rouge": rouge,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
}


def metric_for(task: str) -> str:
    """A task's metric name; embedded tasks and ``*_e`` variants included."""
    from harness.tasks import task_spec

    return task_spec(task).metric


def _first_line_rule(task: str) -> bool:
    base = task[:-2] if task.endswith("_e") else task
    return base in FIRST_LINE_TASKS


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER: the share of the references that occur in the prediction (case-insensitive)."""
    found = [answer.lower() in prediction.lower() for answer in answers]
    return sum(found) / len(found) if found else 0.0


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's QA: 1 if any reference occurs in the prediction (case-insensitive)."""
    return float(any(answer.lower() in prediction.lower() for answer in answers))


SET_METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score_sample(task: str, prediction: str, answers: Sequence[str], all_classes=None) -> float:
    """One sample's score in [0, 1] under its benchmark's rules (LongBench's, RULER's)."""
    metric_name = LONGBENCH_METRICS.get(task.removesuffix("_e"), None) or metric_for(task)
    if metric_name in SET_METRICS:
        return SET_METRICS[metric_name](prediction, answers)
    if _first_line_rule(task):
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[metric_name]
    return max((metric(prediction, answer, all_classes) for answer in answers), default=0.0)


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

"""LongBench v1's metrics, written from its published rules (THUDM/LongBench eval.py, metrics.py):
each scores a prediction against one reference answer; a sample scores the max over its answers
(``per_answer``). ROUGE-L is the summary-level union-LCS of the ``rouge`` package (pltrdy 1.0.1)
that LongBench calls, not ``rouge-score``'s sentence-level rougeL (``harness.tasks.longbench.rouge``)."""
from __future__ import annotations

import re
import string
from collections import Counter
from difflib import SequenceMatcher
from typing import Callable, Sequence

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


# Each against one reference answer, by the name a task spec gives.
ONE_ANSWER: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "rouge": rouge,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
}


def per_answer(metric: Callable[..., float]) -> Callable[..., float]:
    """A metric of one answer as a metric of a sample: the max over its reference answers."""
    def score(prediction: str, answers: Sequence[str], all_classes=None) -> float:
        return max((metric(prediction, answer, all_classes) for answer in answers), default=0.0)

    score.__name__ = metric.__name__
    return score


METRICS = {name: per_answer(metric) for name, metric in ONE_ANSWER.items()}

"""RULER's metrics (its eval/synthetic/constants.py): a prediction against all of a sample's
references, case-insensitive substring matches."""
from __future__ import annotations

from typing import Sequence


def string_match_all(prediction: str, answers: Sequence[str], all_classes=None) -> float:
    """RULER: the share of the references that occur in the prediction (case-insensitive)."""
    found = [answer.lower() in prediction.lower() for answer in answers]
    return sum(found) / len(found) if found else 0.0


def string_match_part(prediction: str, answers: Sequence[str], all_classes=None) -> float:
    """RULER's QA: 1 if any reference occurs in the prediction (case-insensitive)."""
    return float(any(answer.lower() in prediction.lower() for answer in answers))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}

"""A sample is one LongBench-format record plus the task it belongs to."""
from __future__ import annotations

from dataclasses import dataclass, field

REQUIRED_FIELDS = ("input", "context", "answers")


class DataError(ValueError):
    """Bad data: a missing file, a malformed record, an unknown task."""


@dataclass(frozen=True)
class Sample:
    task: str
    id: str
    context: str
    input: str
    answers: list[str]
    all_classes: list[str] | None = None
    length: int = 0  # LongBench's `length`: words in the context
    meta: dict = field(default_factory=dict)


def sample_from_record(record: dict, task: str, where: str) -> Sample:
    """Build a Sample from a LongBench JSONL record; ``where`` names the file and line for errors."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        raise DataError(f"{where}: record is missing required field(s) {', '.join(missing)}")
    answers = record["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise DataError(f"{where}: 'answers' must be a list of strings")
    return Sample(
        task=task,
        id=str(record.get("_id", where)),
        context=str(record["context"]),
        input=str(record["input"]),
        answers=answers,
        all_classes=record.get("all_classes") or None,
        length=int(record.get("length") or len(str(record["context"]).split())),
        meta={k: v for k, v in record.items() if k not in (*REQUIRED_FIELDS, "_id", "all_classes", "length")},
    )

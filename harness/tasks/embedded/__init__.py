"""The embedded suite: long-context tasks generated here from a seed, in LongBench's record format
(``dataset.py``), so a fresh machine runs with no download; scored by LongBench's and RULER's
metrics. ``token_prompts.py`` cuts prompts of exact token lengths from its text."""
from __future__ import annotations

from harness.tasks.embedded import dataset
from harness.tasks.sample import DataError
from harness.tasks.spec import Family


def load(data, tokenizer, tasks):
    words = tuple(data.context_words) if data.context_words else dataset.CONTEXT_WORDS
    # The suite is generated to size: a limit above the default count gets that many samples
    # (each seeded by its index, so the first ones are the same whatever the limit).
    return dataset.generate(seed=data.seed, tasks=tasks, context_words=words,
                            samples_per_task=data.limit or dataset.SAMPLES_PER_TASK)


def check(data) -> None:
    words = data.context_words
    if words is not None and (data.source != "embedded" or not words
                              or not all(isinstance(w, int) and w > 0 for w in words)):
        raise DataError(f"data.context_words is a list of positive word counts for the embedded suite, got {words!r}")


def spec(task: str):
    return dataset.TASKS[task][1] if task in dataset.TASKS else None


FAMILY = Family(name="embedded", sources=("embedded",), tasks=lambda source: tuple(dataset.TASKS), load=load,
                spec=spec, check=check)

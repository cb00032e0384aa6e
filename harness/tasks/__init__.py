"""Datasets as Samples: the embedded suite, RULER (generated at lengths in the model's tokens),
LongBench / LongBench-E, or any LongBench-format JSONL."""
from __future__ import annotations

from pathlib import Path

from harness.tasks.ruler import dataset as ruler
from harness.tasks.embedded import dataset as synthetic
from harness.tasks.longbench.dataset import load_hub, load_local, read_jsonl
from harness.tasks.sample import DataError, Sample
from harness.tasks.spec import LONGBENCH_E_TASKS, TaskSpec, longbench_task, longbench_templates

SOURCES = ("embedded", "ruler", "longbench", "longbench_e", "jsonl")  # data.source (harness.config.DataSettings)


def valid_tasks(source: str) -> tuple[str, ...]:
    if source == "embedded":
        return tuple(synthetic.TASKS)
    if source == "ruler":
        return ruler.TASKS
    if source == "longbench_e":
        return LONGBENCH_E_TASKS
    return tuple(longbench_templates())


def check_data_config(data: "DataSettings") -> None:
    """Everything that can be wrong with a data config, found before any model loads."""
    if data.source not in SOURCES:
        raise DataError(f"unknown data source {data.source!r}; valid: {', '.join(SOURCES)}")
    if data.limit is not None and (not isinstance(data.limit, int) or data.limit < 1):
        raise DataError(f"data.limit must be a positive integer or null, got {data.limit!r}")
    if data.source == "jsonl" or (data.source.startswith("longbench") and data.path):
        path = Path(str(data.path))
        if not path.exists():
            raise DataError(f"data.path {path} does not exist")
    words = data.context_words
    if words is not None and (data.source != "embedded" or not words or not all(isinstance(w, int) and w > 0 for w in words)):
        raise DataError(f"data.context_words is a list of positive word counts for the embedded suite, got {words!r}")
    lengths = data.lengths
    if lengths is not None and (data.source != "ruler" or not lengths
                                or not all(isinstance(n, int) and n >= 256 for n in lengths)):
        raise DataError(f"data.lengths is a list of RULER sample lengths in tokens (each at least 256), got {lengths!r}")
    if data.tasks and data.source != "jsonl":
        allowed = valid_tasks(data.source)
        unknown = [t for t in data.tasks if t not in allowed]
        if unknown:
            raise DataError(f"unknown task(s) {', '.join(unknown)} for {data.source}; valid: {', '.join(allowed)}")


def load_samples(data: "DataSettings", tokenizer=None) -> list[Sample]:
    """The samples of a data config; RULER sizes its samples with the model's ``tokenizer``."""
    check_data_config(data)
    tasks = list(data.tasks) if data.tasks else None
    if data.source == "ruler":
        if tokenizer is None:
            raise DataError("RULER samples are sized in the model's tokens: load_samples needs its tokenizer")
        samples = ruler.generate(tokenizer, seed=data.seed, tasks=tasks, lengths=tuple(data.lengths or ruler.LENGTHS),
                                 samples_per_length=data.limit or ruler.SAMPLES_PER_LENGTH)
        return samples
    if data.source == "embedded":
        words = tuple(data.context_words) if data.context_words else synthetic.CONTEXT_WORDS
        # The suite is generated to size: a limit above the default count gets that many samples
        # (each seeded by its index, so the first ones are the same whatever the limit).
        return synthetic.generate(seed=data.seed, tasks=tasks, context_words=words,
                                  samples_per_task=data.limit or synthetic.SAMPLES_PER_TASK)
    if data.source == "jsonl":
        samples = read_jsonl(Path(str(data.path)), limit=data.limit)
        return [s for s in samples if tasks is None or s.task in tasks]
    tasks = tasks or list(valid_tasks(data.source))
    if data.path:
        return load_local(Path(str(data.path)), tasks, data.source, data.limit)
    return load_hub(data.hub_id, tasks, data.source, data.limit)


def task_spec(task: str) -> TaskSpec:
    """The generation and scoring rules of a task, embedded or LongBench (``*_e`` included)."""
    if task in synthetic.TASKS:
        return synthetic.TASKS[task][1]
    if task in ruler.TASK_FAMILIES:
        return ruler.task_spec(task)
    try:
        return longbench_task(task)
    except KeyError:
        raise DataError(
            f"no rules for task {task!r}: a JSONL record's 'dataset' must name a LongBench task "
            f"({', '.join(longbench_templates())}) or an embedded one ({', '.join(synthetic.TASKS)})"
        ) from None


__all__ = ["DataError", "Sample", "TaskSpec", "check_data_config", "load_samples", "task_spec", "valid_tasks"]

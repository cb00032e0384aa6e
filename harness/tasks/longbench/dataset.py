"""LongBench and LongBench-E records: from a local directory of the official JSONL files, any JSONL
file in the same format, or the hub (a parquet mirror; the original is a script dataset)."""
from __future__ import annotations

import json
from pathlib import Path

from harness.tasks.sample import DataError, Sample, sample_from_record


def read_jsonl(path: Path, task: str | None = None, limit: int | None = None) -> list[Sample]:
    """Records of one JSONL file. ``task`` defaults to each record's ``dataset`` field."""
    samples: list[Sample] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: malformed JSON ({error.msg})") from None
            name = task or (record.get("dataset") if isinstance(record, dict) else None)
            if not name:
                raise DataError(f"{where}: record has no 'dataset' field naming its task")
            samples.append(sample_from_record(record, name, where))
    return select(samples, limit)


def select(samples: list[Sample], limit: int | None) -> list[Sample]:
    """The first ``limit`` samples of each task, in file order (deterministic)."""
    if limit is None:
        return samples
    seen: dict[str, int] = {}
    chosen = []
    for sample in samples:
        if seen.get(sample.task, 0) < limit:
            seen[sample.task] = seen.get(sample.task, 0) + 1
            chosen.append(sample)
    return chosen


def load_local(directory: Path, tasks: list[str], variant: str, limit: int | None) -> list[Sample]:
    """Official layout: ``<dir>/<task>.jsonl`` (LongBench) or ``<dir>/<task>_e.jsonl`` (LongBench-E)."""
    samples = []
    for task in tasks:
        name = f"{task}_e" if variant == "longbench_e" else task
        path = directory / f"{name}.jsonl"
        if not path.is_file():
            raise DataError(f"{path} does not exist (expected the official file {name}.jsonl)")
        samples += read_jsonl(path, task=name, limit=limit)
    return samples


def load_hub(hub_id: str, tasks: list[str], variant: str, limit: int | None) -> list[Sample]:
    """LongBench through ``datasets`` from a parquet mirror on the hub (or a local copy of one:
    ``hub_id`` may be a directory laid out like the mirror, one config per task)."""
    import datasets

    print(f"[data] {variant} from {hub_id} (data.hub_id; data.path=DIR reads the official JSONL files instead)")
    samples = []
    for task in tasks:
        name = f"{task}_e" if variant == "longbench_e" else task
        split = "test" if limit is None else f"test[:{limit}]"
        try:
            rows = datasets.load_dataset(hub_id, name, split=split)
        except Exception as error:  # offline, unknown mirror, missing config: all end the same way
            raise DataError(
                f"could not load {hub_id} config {name!r} ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                "give data.path=DIR with LongBench's JSONL files, or another mirror as data.hub_id"
            ) from error
        samples += [sample_from_record(dict(row), name, f"{hub_id}/{name}#{i}") for i, row in enumerate(rows)]
    return samples

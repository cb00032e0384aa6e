"""LongBench v1 and LongBench-E (English) as their authors generate and score them: records from the
official JSONL files, a hub mirror or any JSONL in the same format (``dataset.py``), the task rules
(``tasks.py``, templates in ``prompts.json``), the metrics (``metrics.py``, ``rouge.py``)."""
from __future__ import annotations

from pathlib import Path

from harness.tasks.longbench import dataset, metrics
from harness.tasks.longbench.tasks import LONGBENCH_E_TASKS, longbench_task, longbench_templates
from harness.tasks.sample import DataError
from harness.tasks.spec import Family


def tasks_of(source: str) -> tuple[str, ...]:
    return LONGBENCH_E_TASKS if source == "longbench_e" else tuple(longbench_templates())


def load(data, tokenizer, tasks):
    if data.source == "jsonl":
        samples = dataset.read_jsonl(Path(str(data.path)), limit=data.limit)
        return [s for s in samples if tasks is None or s.task in tasks]
    tasks = tasks or list(tasks_of(data.source))
    if data.path:
        return dataset.load_local(Path(str(data.path)), tasks, data.source, data.limit)
    return dataset.load_hub(data.hub_id, tasks, data.source, data.limit)


def check(data) -> None:
    if data.source == "jsonl" or (data.source.startswith("longbench") and data.path):
        path = Path(str(data.path))
        if not path.exists():
            raise DataError(f"data.path {path} does not exist")


def spec(task: str):
    try:
        return longbench_task(task)
    except KeyError:
        return None


FAMILY = Family(name="longbench", sources=("longbench", "longbench_e", "jsonl"), tasks=tasks_of, load=load,
                spec=spec, metrics=metrics.METRICS, check=check, any_task=("jsonl",))

"""Benchmark families, a folder each: ``embedded/`` (the suite generated here), ``ruler/`` (RULER,
generated at lengths in the model's tokens), ``longbench/`` (LongBench, LongBench-E and any
LongBench-format JSONL). A folder's ``__init__.py`` defines its ``FAMILY``
(``harness.tasks.spec.Family``): the ``data.source`` values it loads, its tasks, its metrics;
with its Hydra file ``conf/data/<name>.yaml`` that is all a new family takes. This module finds the
families by their folders and answers for all of them: which sources and tasks exist, a data
config's samples, a task's rules, a metric by name."""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from harness.tasks.sample import DataError, Sample
from harness.tasks.spec import Family, Metric, TaskSpec


@cache
def families() -> tuple[Family, ...]:
    """Every family, by folder name (a package under harness/tasks/ with a ``FAMILY``)."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.ispkg:
            found.append(importlib.import_module(f"{__name__}.{info.name}").FAMILY)
    return tuple(found)


def sources() -> tuple[str, ...]:
    """Every ``data.source`` value (``harness.config.DataSettings``)."""
    return tuple(source for family in families() for source in family.sources)


def family_of(source: str) -> Family:
    for family in families():
        if source in family.sources:
            return family
    raise DataError(f"unknown data source {source!r}; valid: {', '.join(sources())}")


def valid_tasks(source: str) -> tuple[str, ...]:
    return family_of(source).tasks(source)


def check_data_config(data: "DataSettings") -> None:
    """Everything that can be wrong with a data config, found before any model loads."""
    family = family_of(data.source)
    if data.limit is not None and (not isinstance(data.limit, int) or data.limit < 1):
        raise DataError(f"data.limit must be a positive integer or null, got {data.limit!r}")
    for each in families():  # each family's own options: set only for its sources, and valid
        if each.check is not None:
            each.check(data)
    if data.tasks and data.source not in family.any_task:
        allowed = valid_tasks(data.source)
        unknown = [t for t in data.tasks if t not in allowed]
        if unknown:
            raise DataError(f"unknown task(s) {', '.join(unknown)} for {data.source}; valid: {', '.join(allowed)}")


def load_samples(data: "DataSettings", tokenizer=None) -> list[Sample]:
    """The samples of a data config; a family that sizes its samples in tokens (RULER) needs the
    model's ``tokenizer``."""
    check_data_config(data)
    return family_of(data.source).load(data, tokenizer, list(data.tasks) if data.tasks else None)


def task_spec(task: str) -> TaskSpec:
    """The generation and scoring rules of a task, whichever family it belongs to."""
    for family in families():
        spec = family.spec(task)
        if spec is not None:
            return spec
    raise DataError(
        f"no rules for task {task!r}: a JSONL record's 'dataset' must name a task of "
        + "; ".join(f"{family.name} ({', '.join(family.tasks(family.sources[0]))})" for family in families())
    )


def metric(name: str) -> Metric:
    """A metric by the name a task spec gives, from whichever family registers it."""
    for family in families():
        if name in family.metrics:
            return family.metrics[name]
    raise KeyError(f"no family registers the metric {name!r}")


__all__ = ["DataError", "Family", "Sample", "TaskSpec", "check_data_config", "families", "load_samples", "metric",
           "sources", "task_spec", "valid_tasks"]

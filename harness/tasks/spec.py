"""What every benchmark family gives the harness: each task's rules (``TaskSpec``) and the family
itself (``Family``: the data sources it loads, its tasks, its metrics), registered by its folder
under ``harness/tasks/`` (see ``harness.tasks``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class TaskSpec:
    name: str
    template: str
    max_new_tokens: int
    metric: str
    chat: bool = True
    first_line: bool = False
    stop: tuple[str, ...] = field(default=())


# A metric scores one prediction against all of a sample's reference answers, in [0, 1].
Metric = Callable[..., float]  # (prediction, answers, all_classes) -> float


@dataclass(frozen=True)
class Family:
    """A benchmark family: the ``data.source`` values it answers to, its tasks, how it loads a data
    config's samples and which metrics its task specs name. A family lives in its own folder under
    ``harness/tasks/`` whose ``__init__.py`` defines ``FAMILY``, beside its Hydra file
    ``conf/data/<name>.yaml``."""

    name: str
    sources: tuple[str, ...]
    tasks: Callable[[str], tuple[str, ...]]     # a source's task names (for data.tasks)
    load: Callable[..., list]                   # (data settings, tokenizer, tasks or None) -> samples
    spec: Callable[[str], TaskSpec | None]      # a task's rules, None when it is not this family's
    metrics: dict[str, Metric] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None  # this family's own data options, for any data config
    any_task: tuple[str, ...] = ()              # sources whose records name their own tasks (jsonl)

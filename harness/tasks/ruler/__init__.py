"""RULER (Hsieh et al., arXiv 2404.06654), generated here at lengths in the model's tokens
(``dataset.py``, its templates in ``templates.json``) and scored by string match (``metrics.py``)."""
from __future__ import annotations

from harness.tasks.ruler import dataset, metrics
from harness.tasks.sample import DataError
from harness.tasks.spec import Family


def load(data, tokenizer, tasks):
    if tokenizer is None:
        raise DataError("RULER samples are sized in the model's tokens: load_samples needs its tokenizer")
    return dataset.generate(tokenizer, seed=data.seed, tasks=tasks, lengths=tuple(data.lengths or dataset.LENGTHS),
                            samples_per_length=data.limit or dataset.SAMPLES_PER_LENGTH)


def check(data) -> None:
    lengths = data.lengths
    if lengths is not None and (data.source != "ruler" or not lengths
                                or not all(isinstance(n, int) and n >= 256 for n in lengths)):
        raise DataError(f"data.lengths is a list of RULER sample lengths in tokens (each at least 256), got {lengths!r}")


def spec(task: str):
    return dataset.task_spec(task) if task in dataset.TASK_FAMILIES else None


FAMILY = Family(name="ruler", sources=("ruler",), tasks=lambda source: dataset.TASKS, load=load, spec=spec,
                metrics=metrics.METRICS, check=check)

"""LongBench's task rules: its 16 English tasks' templates and output lengths come from
``prompts.json`` (data from THUDM/LongBench, MIT), their metrics and chat rules from its code
(pred.py, eval.py); the embedded suite's tasks reuse these templates for the skill they test."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from harness.tasks.spec import TaskSpec

# LongBench scores each task with one metric (its eval.py's dataset2metric).
LONGBENCH_METRICS = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1",
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge",
    "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge",
    "passage_count": "count", "passage_retrieval_en": "retrieval",
    "lcc": "code_sim", "repobench-p": "code_sim",
}
# Tasks LongBench feeds raw (no chat template): few-shot and code completion.
NO_CHAT_TEMPLATE = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
# Few-shot tasks: only the first line of the prediction is scored.
FIRST_LINE_TASKS = {"trec", "triviaqa", "samsum", "lsht"}
LONGBENCH_E_TASKS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)


@cache
def longbench_templates() -> dict[str, dict]:
    raw = json.loads((Path(__file__).with_name("prompts.json")).read_text())
    return {name: spec for name, spec in raw.items() if not name.startswith("_")}


def longbench_task(name: str) -> TaskSpec:
    base = name[:-2] if name.endswith("_e") else name
    templates = longbench_templates()
    if base not in templates:
        raise KeyError(f"unknown LongBench task {name!r}; valid: {', '.join(templates)}")
    spec = templates[base]
    return TaskSpec(
        name=base,
        template=spec["prompt"],
        max_new_tokens=spec["max_new_tokens"],
        metric=LONGBENCH_METRICS[base],
        chat=base not in NO_CHAT_TEMPLATE,
        first_line=base in FIRST_LINE_TASKS,
        stop=("\n",) if base == "samsum" else (),
    )

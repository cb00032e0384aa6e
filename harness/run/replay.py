"""Committed cells replayed at the current code, sample for sample, without publishing anything.

A refactor that moves no output should not cost a regeneration. ``replay`` rebuilds each committed
cell's settings from its ``config.yaml`` (and refuses one whose settings no longer name its
directory: the cell would not be the same cell at this code), runs a fixed subset of its samples
through the same lifecycle as a sweep (``harness.run.group.generate_and_record``: one engine per
group, scores, fidelity, the eviction check) and compares every replayed sample with the committed
one: the prompt text, the output tokens under the near-tie rule (``harness.analysis.regression``)
and, where the tokens are equal, the sample's score. The teacher-forced likelihood passes are left
out (they read the same engine path twice more for numbers that are not outputs).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from harness.analysis.regression import parting
from harness.config import RunSettings, typed
from harness.config.models import resolve_model_path
from harness.records.results import read_jsonl
from harness.run.cell import CellWork, prepare_cell
from harness.run.group import generate_and_record, group_key


@dataclass
class CellReplay:
    """One committed cell against its replay: how many samples replayed and what moved."""

    cell: str                # its run directory, relative to the study's folder
    samples: int = 0
    identical: int = 0       # the same output tokens
    near_ties: int = 0       # parted at a rounding tie: either is the greedy choice
    moved: list[str] = field(default_factory=list)  # "sample: why", for each sample that moved

    def as_dict(self) -> dict:
        return {"cell": self.cell, "samples": self.samples, "identical": self.identical,
                "near_ties": self.near_ties, "moved": self.moved}


def committed_run(cell_dir: Path) -> RunSettings:
    """A committed cell's settings as this code reads them, in its own folder; ``ValueError`` when
    they no longer name that cell (its identity hash moved)."""
    config = yaml.safe_load((cell_dir / "config.yaml").read_text())
    config.pop("provenance", None)
    run = replace(typed(OmegaConf.create(config)), output_dir=str(cell_dir.parents[2]))
    if run.run_dir != cell_dir:
        raise ValueError(f"{cell_dir}: its config names {run.run_dir.name} at this code, not {cell_dir.name}")
    return run


def spaced_ids(rows: list[dict], per_task: int) -> list[str]:
    """A fixed, stratified subset: per task, ``per_task`` samples evenly spaced through the task's
    samples in their committed order (the embedded suite cycles its context sizes and RULER lists
    each length in turn, so the spacing reaches every size and length)."""
    by_task: dict[str, list[str]] = {}
    for row in rows:
        by_task.setdefault(row["task"], []).append(row["id"])
    chosen = []
    for ids in by_task.values():
        step = max(1, len(ids) // per_task)
        chosen += ids[::step][:per_task]
    return chosen


def only(work: CellWork, ids: list[str]) -> CellWork:
    keep = [index for index, sample in enumerate(work.samples) if sample.id in set(ids)]
    return replace(work, samples=[work.samples[i] for i in keep], prompts=[work.prompts[i] for i in keep],
                   answer_ids=[work.answer_ids[i] for i in keep])


def replay(cell_dirs: list[Path], per_task: int = 4, root: Path | None = None) -> list[CellReplay]:
    """Replay ``per_task`` samples per task of every cell (cells sharing an engine replay together)."""
    from transformers import AutoTokenizer

    runs = [committed_run(cell_dir) for cell_dir in cell_dirs]
    groups: dict[str, list[int]] = {}
    for index, run in enumerate(runs):
        groups.setdefault(group_key(run), []).append(index)
    outcome: list[CellReplay | None] = [None] * len(runs)
    for number, members in enumerate(groups.values(), 1):
        committed = {i: {row["id"]: row for row in read_jsonl(cell_dirs[i] / "predictions.jsonl")} for i in members}
        ids = spaced_ids(read_jsonl(cell_dirs[members[0]] / "predictions.jsonl"), per_task)
        model_path = resolve_model_path(runs[members[0]].model.path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        works = [only(prepare_cell(replace(runs[i], force=True, likelihood=False), tokenizer), ids) for i in members]
        with tempfile.TemporaryDirectory() as scratch:
            records = generate_and_record(works, model_path, f"replay {number}/{len(groups)}", Path(scratch) / "vllm.log")
        for i, record in zip(members, records):
            outcome[i] = compare(record.rows, committed[i], str(cell_dirs[i].relative_to(root) if root else cell_dirs[i]))
    return outcome  # type: ignore[return-value]


def compare(rows: list[dict], committed: dict[str, dict], cell: str) -> CellReplay:
    """Replayed rows against the committed ones, by sample id."""
    result = CellReplay(cell)
    for row in rows:
        want = committed.get(row["id"])
        result.samples += 1
        if want is None:
            result.moved.append(f"{row['id']}: not among the committed samples")
            continue
        if row["prompt"] != want["prompt"]:
            result.moved.append(f"{row['id']}: the prompt text differs")
            continue
        why = parting(want["output_token_ids"], row["output_token_ids"], want["top_logprobs"], row["top_logprobs"])
        if why:
            result.moved.append(f"{row['id']}: {why}")
        elif want["output_token_ids"] != row["output_token_ids"]:
            result.near_ties += 1
        elif row["score"] != want["score"]:
            result.moved.append(f"{row['id']}: the same output scores {row['score']} against {want['score']}")
        else:
            result.identical += 1
    return result

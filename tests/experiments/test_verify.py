"""Verification by replay without an engine: which cells and samples replay, how a replayed sample
is judged against the committed one, and when a study counts as verified."""
from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from harness.analysis.labels import budget_label, variant_label
from harness.records.results import read_jsonl
from harness.run.replay import committed_run, compare, spaced_ids
from tests.support import ROOT

sys.path.insert(0, str(ROOT / "experiments"))

import regenerate  # noqa: E402

ACCURACY = [step for step in regenerate.STEPS if not step.folder.startswith("throughput/") and not step.serving]


@pytest.mark.parametrize("step", ACCURACY, ids=lambda step: step.name)
def test_every_committed_cell_is_named_by_its_config_at_this_code(step):
    """A replay needs the cell's own settings: reading its config.yaml at this code names its folder."""
    for cell in step.cells():
        assert committed_run(cell).run_dir == cell


def test_a_config_that_no_longer_names_its_cell_is_refused(tmp_path):
    (cell,) = [c for c in ACCURACY[0].cells() if c.name.startswith("full_")]
    moved = tmp_path / "results" / "smollm2-135m" / "synthetic" / "full_bs32_00000000"
    moved.mkdir(parents=True)
    (moved / "config.yaml").write_text((cell / "config.yaml").read_text())
    with pytest.raises(ValueError, match="names full_bs32_"):
        committed_run(moved)


def test_the_subset_spaces_samples_through_every_task_length_and_context_size():
    ruler = next(step for step in ACCURACY if step.name == "ruler")
    rows = read_jsonl(regenerate.replay_subset(ruler)[0] / "predictions.jsonl")
    chosen = {row["id"]: row for row in rows if row["id"] in set(spaced_ids(rows, 4))}
    tasks = {row["task"] for row in rows}
    assert len(chosen) == 4 * len(tasks)
    for task in tasks:
        assert {row["length"] for row in chosen.values() if row["task"] == task} == {1024, 2048}
    embedded = read_jsonl(regenerate.replay_subset(ACCURACY[0])[0] / "predictions.jsonl")
    ids = spaced_ids(embedded, 4)
    assert [i.rsplit("-", 1)[1] for i in ids[:4]] == ["0", "5", "10", "15"]  # the four context sizes in turn


def test_the_cells_are_full_cache_and_one_per_budget_paged_first():
    for step in ACCURACY:
        if not step.cells():
            continue  # a planned study not made yet: nothing to replay
        cells = regenerate.replay_subset(step)
        # full cache first and PagedEviction's cell first of the evicting ones, where the study has
        # them (kvzip_schedule has KVzip's cells alone, its full cache in ruler_context beside it)
        names = [cell.name for cell in step.cells()]
        has_full, has_paged = any(n.startswith("full_") for n in names), any(n.startswith("paged_") for n in names)
        evicting = cells[1:] if has_full else cells
        assert not has_full or cells[0].name.startswith("full_"), cells
        assert not has_paged or evicting[0].name.startswith("paged_"), cells
        assert not any(cell.name.startswith("full_") for cell in evicting), cells
        configs = [yaml.safe_load((cell / "config.yaml").read_text()) for cell in evicting]
        committed = {budget_label(yaml.safe_load((cell / "config.yaml").read_text())) for cell in step.cells()} - {"all"}
        assert sorted(budget_label(config) for config in configs) == sorted(committed)  # one per budget label
        variants = [variant_label(config) for config in configs]
        # the policies (variants) taken in turn; a study with fewer evicting variants than budgets (a
        # study whose cells are committed chunk by chunk, such as Gemma's RULER) takes each once first
        offered = {variant_label(yaml.safe_load((cell / "config.yaml").read_text())) for cell in step.cells()} - {"full"}
        assert len(set(variants)) == min(len(variants), len(offered)), (step.name, variants)
    for step in regenerate.STEPS:
        if step.folder.startswith("throughput/") and step.cells():  # (a planned setting not made yet: none)
            (cell,) = regenerate.replay_subset(step)
            stored = json.loads(cell.read_text())["cell"]
            assert stored["trial"] == 1 and not stored.get("stock")
            if step.name == "throughput/reconstruction":
                assert stored["policy"] == "kvzip", "a prefill setting replays its subject, whose passes it measures"


def rows(tokens, score=1.0, prompt="p", top=None):
    top = top or [[[t, -0.1], [t + 1, -5.0]] for t in tokens]
    return {"id": "s", "prompt": prompt, "output_token_ids": tokens, "top_logprobs": top, "score": score}


def test_a_replayed_sample_is_judged_by_prompt_tokens_and_score():
    want = {"s": rows([1, 2, 3])}
    assert compare([rows([1, 2, 3])], want, "c").identical == 1
    assert "prompt text differs" in compare([rows([1, 2, 3], prompt="q")], want, "c").moved[0]
    assert "diverges at output token 1" in compare([rows([1, 9, 3])], want, "c").moved[0]
    assert "scores 0.5 against 1.0" in compare([rows([1, 2, 3], score=0.5)], want, "c").moved[0]
    tie = [[[1, -0.1], [9, -0.1002]], [[2, -0.1], [9, -0.1001]], [[3, -0.1], [4, -5.0]]]
    parted = compare([rows([1, 9, 3], top=[[[1, -0.1], [9, -0.1002]], [[9, -0.1], [2, -0.1001]], tie[2]])],
                     {"s": rows([1, 2, 3], top=tie)}, "c")
    assert parted.near_ties == 1 and not parted.moved


def test_a_study_counts_as_verified_only_at_this_code_for_the_cells_it_replayed(tmp_path, monkeypatch):
    monkeypatch.setattr(regenerate, "ROOT", tmp_path)
    step = regenerate.throughput("demo", 1.0)
    cells = tmp_path / "results" / "throughput" / "demo" / "cells"
    cells.mkdir(parents=True)
    (cells / "a.json").write_text(json.dumps({"provenance": {"code_version": "old"},
                                              "cell": {"policy": "paged", "budget": 256, "trial": 1}}))
    record = {"verdict": "verified", "code_version": "new", "ran_at": ["old"], "cells": 1}
    (cells.parent / regenerate.VERIFIED).write_text(json.dumps(record))
    assert regenerate.status(step, "new")[0] == "to run"  # no summary of them yet
    (cells.parent / "summary.csv").write_text("cell\n")
    assert regenerate.status(step, "new")[0] == "verified"
    assert regenerate.status(step, "newer")[0] == "to run"  # the code moved again since
    (cells / "b.json").write_text(json.dumps({"provenance": {"code_version": "other"}}))
    assert regenerate.status(step, "new")[0] == "to run"  # a cell the verification did not cover
    (cells / "b.json").unlink()
    # a cell rerun at this code (a retrained policy's) beside the verified ones: still verified, once
    # the summary is newer than it
    (cells / "c.json").write_text(json.dumps({"provenance": {"code_version": "new"}}))
    os.utime(cells.parent / "summary.csv", (1, 1))
    assert regenerate.status(step, "new")[0] == "partial"
    (cells.parent / "summary.csv").touch()
    assert regenerate.status(step, "new")[0] == "verified"
    assert regenerate.replay_subset(step, "new") == [cells / "a.json"]
    (cells.parent / regenerate.VERIFIED).write_text(json.dumps({**record, "verdict": "moved"}))
    assert regenerate.status(step, "new")[0] == "partial"
    (cells / "c.json").unlink()
    assert regenerate.status(step, "new")[0] == "to run"

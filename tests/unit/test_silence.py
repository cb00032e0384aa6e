"""Samples that score 0 in every cell, and the task score without them (harness.analysis.silence; no engine)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.analysis.aggregate import group_scores
from harness.analysis.silence import (HEADING, dead_samples, live_samples, live_scores, live_table,
                                      sign_changes, silence_section)
from harness.analysis.stats import bca_interval
from tests.support import ROOT


def series(values: list[float], task: str) -> pd.Series:
    return pd.Series(values, index=[f"{task}-{i}" for i in range(len(values))], dtype=float)


def runs_of(**cells: dict[str, list[float]]) -> dict[str, dict[str, pd.Series]]:
    return {run: {task: series(values, task) for task, values in by_task.items()} for run, by_task in cells.items()}


# Three cells, two tasks of four samples. qa-0 and code-3 score 0 everywhere (dead); qa-1 is 0 in
# full and h2o but scores in snapkv (live); code-0 scores only in full (live).
RUNS = runs_of(
    full={"qa": [0, 0, 1, 0.5], "code": [0.2, 0.4, 0.6, 0]},
    h2o={"qa": [0, 0, 1, 0.25], "code": [0, 0.4, 0.2, 0]},
    snapkv={"qa": [0, 0.5, 0, 0.5], "code": [0, 0.2, 0.6, 0]},
)


def frame_of(labels: dict[str, tuple[str, float | None]]) -> pd.DataFrame:
    """Summary-frame rows as aggregate builds them: one per run and task, raw budgets."""
    return pd.DataFrame([{"run_dir": run, "variant": variant, "policy.name": variant.split("[")[0], "budget": budget,
                          "budget_ratio": None, "task": task} for run, (variant, budget) in labels.items()
                         for task in ("qa", "code")])


FRAME = frame_of({"full": ("full", None), "h2o": ("h2o", 256), "snapkv": ("snapkv", 256)})


def test_dead_counts_overall_and_per_task():
    dead = dead_samples(RUNS)
    assert (dead.total, dead.dead_total, dead.live_total, dead.left_out) == (8, 2, 6, 0)
    assert list(dead.dead["qa"]) == ["qa-0"] and list(dead.dead["code"]) == ["code-3"]
    assert dead.per_task_text() == "code 1/4, qa 1/4"
    some = dead_samples(runs_of(full={"qa": [0, 1], "code": [1]}, h2o={"qa": [0, 0], "code": [0.5]}))
    assert some.per_task_text() == "code 0/1, qa 1/2" and some.per_task_text(dead_only=True) == "qa 1/2"
    assert dead.text(full_cache=True).startswith("2 of 8 samples (25%) score 0 in all 3 cells, full cache included: "
                                                 "code 1/4, qa 1/4.")


def test_a_sample_dead_in_one_run_but_not_another_is_live():
    dead = dead_samples(RUNS)
    assert "qa-1" in dead.live("qa") and "code-0" in dead.live("code")
    # Alone, full cache has qa-1 at 0: dead there, live once snapkv (which scores it) joins.
    assert "qa-1" in dead_samples({"full": RUNS["full"]}).dead["qa"]


def test_only_samples_present_in_every_run_count():
    runs = {run: dict(by_task) for run, by_task in RUNS.items()}
    runs["h2o"]["qa"] = runs["h2o"]["qa"].drop("qa-0")  # the dead sample is missing from one run
    runs["h2o"]["extra"] = series([0, 0], "extra")  # a task only one run has
    dead = dead_samples(runs)
    assert dead.total == 7 and dead.dead_total == 1 and dead.left_out == 1 + 2
    assert "extra" not in dead.samples and "qa-0" not in dead.samples["qa"]


def test_live_scores_equal_a_hand_computation():
    live = live_samples(RUNS)
    assert list(live["full"]["qa"].index) == ["qa-1", "qa-2", "qa-3"]
    assert list(live["full"]["code"].index) == ["code-0", "code-1", "code-2"]
    intervals = live_scores(RUNS)
    # h2o on live samples: qa (0 + 1 + 0.25) / 3, code (0 + 0.4 + 0.2) / 3; mean over the two tasks x 100.
    assert intervals["h2o"].estimate == pytest.approx(round(100 * ((1.25 / 3) + (0.6 / 3)) / 2, 2))
    by_hand = bca_interval({"qa": np.array([0, 1, 0.25]), "code": np.array([0, 0.4, 0.2])}, scale=100, digits=2)
    assert intervals["h2o"] == by_hand
    assert intervals["full"].samples == 6


def test_a_fully_dead_task_drops_out_of_the_live_average():
    runs = {run: dict(by_task, never=series([0, 0, 0], "never")) for run, by_task in RUNS.items()}
    dead = dead_samples(runs)
    assert dead.dead_tasks == ["never"] and dead.live_tasks == ["code", "qa"]
    assert "never" not in live_samples(runs)["full"]
    assert live_scores(runs) == live_scores(RUNS)  # the dead task changes no cell's live score
    text = "\n".join(silence_section(FRAME, runs))
    assert "never has no live sample and drops out: the mean is over the other 2 task(s)." in text
    assert (len(dead.samples["never"]), len(dead.dead["never"]), len(dead.live("never"))) == (3, 3, 0)


def test_uniform_live_shares_shrink_every_difference_by_one_factor():
    # Both tasks have live share 3/4: a difference of main averages is 0.75 x the live one.
    dead = dead_samples(RUNS)
    common = {run: np.mean([s.mean() for s in by_task.values()]) for run, by_task in RUNS.items()}
    live = {run: np.mean([s.mean() for s in by_task.values()]) for run, by_task in live_samples(RUNS).items()}
    for a, b in [("full", "h2o"), ("h2o", "snapkv"), ("full", "snapkv")]:
        assert common[a] - common[b] == pytest.approx(0.75 * (live[a] - live[b]))
    assert dead.share("qa") == dead.share("code") == 0.75
    text = "\n".join(silence_section(FRAME, RUNS))
    assert "this table's times 0.75 (the live share 75%): same sign, shrunk uniformly" in text


def test_unequal_live_shares_can_change_a_differences_sign():
    # Task a: every sample live, X - Y = -0.5. Task b: 1 of 4 live, X - Y = +1 there.
    # Live average: (-0.5 + 1) / 2 = +0.25; main: (-0.5 + 1/4) / 2 = -0.125.
    runs = runs_of(x={"a": [0.5], "b": [1, 0, 0, 0]}, y={"a": [1.0], "b": [0, 0, 0, 0]})
    intervals = live_scores(runs)
    assert intervals["x"].estimate - intervals["y"].estimate == pytest.approx(25)
    assert sign_changes(runs) == (1, 1)
    frame = frame_of({"x": ("paged", 256), "y": ("h2o", 256)})
    text = "\n".join(silence_section(frame, runs))
    assert "can change sign. Of the 1 pairs of cells, 1 has a difference of averages of opposite sign" in text
    assert "full cache included" not in text


def test_section_has_heading_counts_and_policy_by_budget_table():
    lines = silence_section(FRAME, RUNS)
    assert lines[0] == HEADING
    text = "\n".join(lines)  # a table is one entry of several lines, as aggregate's sections hold them
    rows = text.splitlines()
    header = next(line for line in rows if line.startswith("| policy"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["policy", "all", "256"]
    assert "over the 6 live samples" in text
    row = next(line for line in rows if line.startswith("| h2o"))
    h2o = live_scores(RUNS)["h2o"]
    assert f"{h2o.estimate:.1f} ({h2o.low:.1f}, {h2o.high:.1f})" in row


def test_no_dead_sample_no_table():
    runs = runs_of(full={"qa": [1, 0.5]}, h2o={"qa": [0, 0.5]})
    lines = silence_section(frame_of({"full": ("full", None), "h2o": ("h2o", 256)}), runs)
    assert lines[:3] == [HEADING, "", "No sample scores 0 in all 2 cells (of 2 samples). Only samples present in every "
                                      "cell count (here every sample is)."]
    assert "|" not in "\n".join(lines)


def test_live_table_orders_rows_and_budgets_as_the_summaries_do():
    labels = pd.DataFrame({"variant": ["snapkv", "full", "snapkv", "h2o", "snapkv"],
                           "budget": ["1024", "all", "256", "r0.5", "r0.25"]},
                          index=["a", "b", "c", "d", "e"])
    intervals = {run: bca_interval({"t": np.array([0.0, 1.0])}) for run in labels.index}
    table = live_table(labels, intervals)
    assert list(table.index) == ["full", "h2o", "snapkv"]
    assert list(table.columns) == ["all", "256", "1024", "r0.25", "r0.5"]


# ---------------------------------------------------------------- the committed studies
def committed(study: str) -> pd.DataFrame:
    from harness.analysis.aggregate import find_runs, run_rows

    return pd.DataFrame([row for run in find_runs([ROOT / "results" / study]) for row in run_rows(run)])


@pytest.mark.parametrize("study, dead, total, per_task", [
    ("cpu_accuracy", 32, 80, {"code_completion": 8, "key_retrieval": 1, "multi_doc_qa": 16, "single_doc_qa": 7}),
    pytest.param("ruler", 36, 144, {"niah_multikey_1_generated": 2, "niah_multikey_2": 10, "niah_multikey_3": 11,
                                    "qa_generated": 8, "vt": 5}, marks=pytest.mark.slow),  # 144 runs' records (3 s)
    ("ablation", 33, 80, {"code_completion": 8, "key_retrieval": 1, "multi_doc_qa": 17, "single_doc_qa": 7}),
])
def test_committed_studies_dead_counts(study, dead, total, per_task):
    frame = committed(study)
    assert frame.groupby(["model.name", "data.name"]).ngroups == 1
    scores = group_scores(frame)
    counts = dead_samples(scores)
    assert (counts.dead_total, counts.total, counts.left_out) == (dead, total, 0)
    assert {task: len(ids) for task, ids in counts.dead.items() if len(ids)} == per_task
    assert counts.runs == frame["run_dir"].nunique()
    assert counts.per_task_text(dead_only=True) == ", ".join(f"{task} {n}/{len(counts.samples[task])}"
                                                           for task, n in sorted(per_task.items()))
    lines = silence_section(frame, scores)
    assert f"{dead} of {total} samples" in lines[2] and "full cache included" in lines[2]


def test_committed_full_cache_live_score_is_its_average_rescaled():
    # Full cache's live score, task by task, is its scores.json task score divided by the live share.
    frame = committed("cpu_accuracy")
    scores = group_scores(frame)
    full = frame[frame["policy.name"] == "full"]
    run = full["run_dir"].iloc[0]
    dead = dead_samples(scores)
    expected = np.mean([row["score"] / dead.share(row["task"]) for _, row in full.iterrows()])
    assert live_scores(scores, dead)[run].estimate == pytest.approx(expected, abs=0.01 * len(full))
    assert Path(run).is_dir()

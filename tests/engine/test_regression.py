"""CI regression, sample by sample: rerun the fixed configuration and compare every sample's output
tokens with results/ci_baseline under the near-tie rule (harness.analysis.regression).

Regenerate the baseline on purpose (and commit it) with:
    rm -rf results/ci_baseline && python run.py -m +experiment=ci_regression hydra/launcher=basic output_dir=results/ci_baseline
A newly registered policy has no cells there yet: the first test fails, alone, naming the command
that adds its cells only (``tests.support.ci_baseline.add_cells_command``); the comparison reruns the
policies the baseline holds.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.analysis.regression import cells, compare, parting
from harness.records.results import read_jsonl
from tests.support import ROOT
from tests.support.ci_baseline import CI_BASELINE, baseline_policies, coverage_problems, swept_policies

pytestmark = pytest.mark.engine


SWEPT = swept_policies()  # what ${kv_policies:} sweeps
CELLS = 1 + 2 * (len(SWEPT) - 1)  # full cache once, every other policy at two budgets
# What the comparison reruns: the swept policies the committed baseline holds (all of them, unless a
# newly registered one awaits its cells: the test below fails for that, and only it).
COMPARED = [name for name in SWEPT if name in baseline_policies()]
COMPARED_CELLS = 1 + 2 * (len(COMPARED) - 1)


def test_the_baseline_covers_every_registered_policy_and_can_catch_a_regression():
    problems = coverage_problems()
    assert not problems, "\n".join(problems)
    cells = [p for p in CI_BASELINE.rglob("predictions.jsonl")]
    assert sorted({p.parent.name.split("_b")[0] for p in cells}) == sorted(SWEPT)
    assert len(cells) == CELLS, "full cache once, every other policy at two budgets"
    for predictions in cells:
        rows = read_jsonl(predictions)
        by_task = {task: [r for r in rows if r["task"] == task] for task in {r["task"] for r in rows}}
        assert by_task and all(len(samples) >= 10 for samples in by_task.values()), predictions
        assert all(r["output_token_ids"] and len(r["top_logprobs"]) == len(r["output_token_ids"]) for r in rows)
    full = read_jsonl(next(p for p in cells if p.parent.name.startswith("full_")))
    for task in {r["task"] for r in full}:
        assert sum(r["score"] for r in full if r["task"] == task) > 0, f"full cache answers {task}"
    # Decode eviction happens every block_size (32) generated tokens: some samples must get there.
    assert max(r["output_tokens"] for r in full) > 32


def test_every_sample_matches_the_committed_reference(tmp_path):
    done = subprocess.run(
        [sys.executable, "run.py", "-m", "+experiment=ci_regression", f"policy={','.join(COMPARED)}", f"output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=3600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # The sweep shares prefill (one engine, every prompt prefilled once); the reference was made
    # with one engine per cell: every sample must still match.
    assert f"{COMPARED_CELLS} cell(s) (full cache, " in done.stdout and "group 1/1 finished" in done.stdout
    assert all(not json.loads(p.read_text())["isolated"] for p in tmp_path.glob("*/*/*/perf.json"))
    problems = compare(CI_BASELINE, tmp_path)
    assert not problems, "samples moved:\n" + "\n".join(problems[:20])


# PagedEviction with its decode victim replaced by the newest block (block selection broken, the
# run is paged alone): a real engine run of a broken policy, which the sample-by-sample comparison
# must catch.
BROKEN = """
import sys, runpy
from policies.selection import ScoredBlockPolicy
ScoredBlockPolicy.select_victim = lambda self, scores, tokens: tokens // self.block_size - 1
sys.argv = ["run.py", *sys.argv[1:]]
runpy.run_path("run.py", run_name="__main__")
"""


def test_a_broken_policy_fails_the_comparison(tmp_path):
    done = subprocess.run(
        # four samples per task (the first four of the baseline's ten, the same samples): enough to catch it
        [sys.executable, "-c", BROKEN, "+experiment=ci_regression", "policy=paged", "budget=256", "data.limit=4",
         f"output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=1800, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # Its cell is named by its config, data.limit included, so it is compared with the baseline's
    # paged_b256 cell sample by sample under the rule compare() applies (parting).
    (name, run), = cells(tmp_path).items()
    assert name.startswith("smollm2-135m/synthetic/paged_b256_"), name
    reference = next(path for cell, path in cells(CI_BASELINE).items() if cell.split("/")[-1].startswith("paged_b256_"))
    expected = {row["id"]: row for row in read_jsonl(reference / "predictions.jsonl")}
    measured = read_jsonl(run / "predictions.jsonl")
    assert len(measured) == 12 and all(row["id"] in expected for row in measured), "the baseline's first four per task"
    moved = [row["id"] for row in measured if parting(expected[row["id"]]["output_token_ids"], row["output_token_ids"],
                                                       expected[row["id"]]["top_logprobs"], row["top_logprobs"])]
    assert len(moved) >= 3, f"evicting the newest block changes many samples, not {len(moved)}"

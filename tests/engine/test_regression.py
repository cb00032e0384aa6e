"""CI regression, sample by sample: rerun the fixed configuration on the first SAMPLES samples of
each task (every cell: every policy at both budgets, every task) and compare each sample's output
tokens with results/ci_baseline's under the near-tie rule (harness.analysis.regression); the
baseline holds ten per task.

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

from harness.records.results import read_jsonl
from tests.support import ROOT
from tests.support.ci_baseline import (CI_BASELINE, baseline_cells, baseline_policies, cell_stem,
                                       compare_first_samples, coverage_problems, swept_policies)

pytestmark = pytest.mark.engine


SWEPT = swept_policies()  # what ${kv_policies:} sweeps
CELLS = 1 + 2 * (len(SWEPT) - 1)  # full cache once, every other policy at two budgets
# What the comparison reruns: the swept policies the committed baseline holds (all of them, unless a
# newly registered one awaits its cells: the test below fails for that, and only it).
COMPARED = [name for name in SWEPT if name in baseline_policies()]
COMPARED_CELLS = 1 + 2 * (len(COMPARED) - 1)
# The rerun's samples per task: the baseline's first four of ten (CI time: the shared-prefill sweep
# runs prompt by prompt, every cell's request at once, so its time goes with the samples: about
# 290 s for ten in the fresh-clone CI, 124 s for four alone). Four per task are both context
# lengths twice (the samples alternate 600 and 900 words), 12 per cell and 300 in all, and they
# are the samples test_a_broken_policy_fails_the_comparison shows catch a broken policy.
SAMPLES = 4


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


def test_every_rerun_sample_matches_the_committed_reference(tmp_path):
    done = subprocess.run(
        [sys.executable, "run.py", "-m", "+experiment=ci_regression", f"policy={','.join(COMPARED)}",
         f"data.limit={SAMPLES}", f"output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=3600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # The sweep shares prefill (one engine, every prompt prefilled once); the reference was made
    # with one engine per cell: every sample must still match.
    assert f"{COMPARED_CELLS} cell(s) (full cache, " in done.stdout and "group 1/1 finished" in done.stdout
    assert all(not json.loads(p.read_text())["isolated"] for p in tmp_path.glob("*/*/*/perf.json"))
    problems = compare_first_samples(tmp_path, SAMPLES)
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
        # the comparison's samples (the first SAMPLES of the baseline's ten per task)
        [sys.executable, "-c", BROKEN, "+experiment=ci_regression", "policy=paged", "budget=256",
         f"data.limit={SAMPLES}", f"output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=1800, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # Its one cell is compared with the baseline's paged_b256 cell sample by sample, by the comparison
    # the test above applies (its cell is named by its config, data.limit included: compared by stem);
    # every other baseline cell is missing here.
    (run,) = [path for path in tmp_path.rglob("predictions.jsonl")]
    stem = f"smollm2-135m/synthetic/{cell_stem(run.parent.name)}"
    assert stem == "smollm2-135m/synthetic/paged_b256_bs32", stem
    assert len(read_jsonl(run)) == 3 * SAMPLES
    problems = compare_first_samples(tmp_path, SAMPLES)
    missing = [problem for problem in problems if problem.endswith(f": missing from {tmp_path}")]
    assert len(missing) == len(baseline_cells()) - 1 and not any(problem.startswith(stem + ":") for problem in missing)
    moved = [problem for problem in problems if problem.startswith(stem + " ")]
    assert len(moved) + len(missing) == len(problems)
    assert len(moved) >= 3, f"evicting the newest block changes many samples, not {len(moved)}"

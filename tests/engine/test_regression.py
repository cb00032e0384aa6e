"""CI regression, sample by sample: rerun the fixed configuration on the first SAMPLES samples of
each task (every cell: every policy at both budgets, every task) and compare each sample's output
tokens with results/ci_baseline's under the near-tie rule (harness.analysis.regression); the
baseline holds ten per task. The same sweep runs a broken copy of PagedEviction beside them, which
the same comparison must catch (one run.py process for both tests: CI time).

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
from pathlib import Path

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
# The rerun's samples per task: the baseline's first two of ten (CI time: the shared-prefill sweep
# runs prompt by prompt, every cell's request at once, so its time goes with the samples: about
# 290 s for ten in the fresh-clone CI, 124 s for four alone, 170 s for four of 25 cells). Two per
# task are each task's two context lengths (the samples alternate 600 and 900 words: prompts of
# 871 to 2,818 tokens, over both budgets), 6 per cell and 150 compared in all. Every one is evicted
# in prefill, and in every evicting cell the code completion answers (64 tokens) evict in decode
# too: the comparison test asserts both of its rerun, so a change to either eviction of any policy
# reaches a compared sample. They are the samples test_a_broken_policy_fails_the_comparison shows
# catch a broken policy (its decode victim moved: both code completion samples of each cell).
SAMPLES = 2


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


# A broken PagedEviction, registered in the sweep's process only as ``broken_paged``: PagedEviction's
# own score (policies/paged.py) with its decode victim replaced by the newest block (block selection
# broken; every other policy's selection, PagedEviction's included, left as it is). On CPU the
# engine core and its one worker run in run.py's process (conf/engine/cpu.yaml in_process: true sets
# VLLM_ENABLE_V1_MULTIPROCESSING=0, harness/engine/llm.py:79: vLLM's InprocClient,
# vllm/v1/engine/core_client.py:133; one worker is the "uni" executor, vllm/config/parallel.py:1079,
# its UniProcExecutor in the same process, vllm/v1/executor/abstract.py:90), so
# the patched selection is the one the engine evicts with. run.py then runs as ``python run.py`` would.
WITH_BROKEN_POLICY = """
import sys, runpy
from policies.paged import value_key_ratio
from policies.registry import REGISTRY, register_score
from policies.selection import ScoredBlockPolicy
register_score("broken_paged", granularity="block", static=True)(value_key_ratio)
broken, select_victim = REGISTRY["broken_paged"].score, ScoredBlockPolicy.select_victim
ScoredBlockPolicy.select_victim = lambda self, scores, tokens: (
    tokens // self.block_size - 1 if isinstance(self.score, broken) else select_victim(self, scores, tokens))
sys.argv = ["run.py", *sys.argv[1:]]
runpy.run_path("run.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def rerun(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """One shared-prefill sweep (one engine, every prompt prefilled once) of the compared policies and
    ``broken_paged`` at both budgets, on the comparison's samples. Returns the compared cells'
    directory, the broken cells' (each filed under the name of the PagedEviction cell it breaks,
    ``paged_b256_bs32_<digest>``, so the comparison pairs it with that baseline cell) and the run."""
    out = tmp_path_factory.mktemp("rerun")
    done = subprocess.run(
        [sys.executable, "-c", WITH_BROKEN_POLICY, "-m", "+experiment=ci_regression",
         f"policy={','.join([*COMPARED, 'broken_paged'])}", f"data.limit={SAMPLES}", f"output_dir={out / 'compared'}"],
        capture_output=True, text=True, timeout=3600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    broken = out / "broken"
    for cell in sorted((out / "compared").glob("*/*/broken_paged_*")):
        filed = broken / cell.parent.relative_to(out / "compared") / cell.name.removeprefix("broken_")
        filed.parent.mkdir(parents=True, exist_ok=True)
        cell.rename(filed)
    return out / "compared", broken, done


def test_every_rerun_sample_matches_the_committed_reference(rerun):
    compared, _, done = rerun
    # The sweep shares prefill (one engine, every prompt prefilled once); the reference was made
    # with one engine per cell: every sample must still match.
    assert f"{COMPARED_CELLS + 2} cell(s) (full cache, " in done.stdout and "group 1/1 finished" in done.stdout
    assert all(not json.loads(p.read_text())["isolated"] for p in compared.glob("*/*/*/perf.json"))
    # Every compared sample of an evicting cell was evicted in prefill, and each such cell evicted in
    # decode too (SAMPLES says why the comparison needs both).
    evicting = [read_jsonl(p) for p in compared.glob("*/*/*/predictions.jsonl") if not p.parent.name.startswith("full_")]
    assert len(evicting) == COMPARED_CELLS - 1
    assert all(row["evictions"]["prefill"] == 1 for rows in evicting for row in rows)
    assert all(sum(row["evictions"]["decode"] for row in rows) > 0 for rows in evicting)
    problems = compare_first_samples(compared, SAMPLES)
    assert not problems, "samples moved:\n" + "\n".join(problems[:20])


def test_a_broken_policy_fails_the_comparison(rerun):
    """The sweep's ``broken_paged`` cells, each compared with the baseline's PagedEviction cell at its
    budget sample by sample, by the comparison the test above applies (a cell's name carries its
    config's digest, data.limit included: compared by stem); every other baseline cell is missing
    here. It ran on the engine the passing cells ran on, so it is the policy, not the run, that moved."""
    _, broken, _ = rerun
    runs = sorted(broken.rglob("predictions.jsonl"))
    stems = [f"smollm2-135m/synthetic/{cell_stem(run.parent.name)}" for run in runs]
    assert stems == ["smollm2-135m/synthetic/paged_b256_bs32", "smollm2-135m/synthetic/paged_b512_bs32"], stems
    assert all(len(read_jsonl(run)) == 3 * SAMPLES for run in runs)
    problems = compare_first_samples(broken, SAMPLES)
    missing = [problem for problem in problems if problem.endswith(f": missing from {broken}")]
    assert len(missing) == len(baseline_cells()) - 2 and not any(problem.startswith(stem + ":")
                                                                 for stem in stems for problem in missing)
    moved = {stem: [problem for problem in problems if problem.startswith(stem + " ")] for stem in stems}
    assert sum(map(len, moved.values())) + len(missing) == len(problems)
    counts = {stem.rsplit("/", 1)[1]: len(found) for stem, found in moved.items()}
    # (both code completion samples in each cell, with SAMPLES = 2: the answers that evict in decode)
    assert all(count >= 2 for count in counts.values()), f"evicting the newest block changes samples, not {counts}"

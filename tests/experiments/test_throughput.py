"""The throughput benchmark (harness.bench.throughput, experiments/throughput.py): settings are
checked before any engine starts, and its report lines say what the trials measured. The small
real run showing the mechanism the paper's claim rests on: tests/engine/test_throughput.py."""
from __future__ import annotations

import sys
from dataclasses import replace

import pytest

import pandas as pd

from harness.analysis.stats import ratio_interval
from harness.bench.throughput import Cell, Setting, check_setting, engine_spec, overhead_lines, trial_lines
from tests.support import ROOT
from tests.support.throughput import CEILING, FULL, PAGED, TINY, setting

sys.path.insert(0, str(ROOT / "experiments"))
import throughput as experiment  # noqa: E402


def test_pools_are_sized_in_full_length_requests():
    s = setting(FULL, CEILING)
    assert TINY.blocks_per_request == 16
    assert s.pool_blocks(FULL) == 16 and s.pool_blocks(CEILING) == 64
    spec = engine_spec(s, PAGED, [[1, 2]], "/m")
    assert spec["engine"]["num_kv_blocks"] == 17, "one more for vLLM's null block"
    assert spec["eviction"] == {"policy": "paged", "budget": 64} and "eviction" not in engine_spec(s, FULL, [[1]], "/m")
    assert engine_spec(s, Cell("full", stock=True), [[1]], "/m")["stock"] is True


def test_a_cpu_cell_starts_the_engine_every_committed_cell_ran():
    """The bench's engine is cpu.yaml's with the cell's changes (harness.config.engine_settings);
    written out here, it is the engine batch_run's own defaults gave before, 4 GiB for KV included,
    so a committed cell replays (harness.bench.replay) on the same engine."""
    from dataclasses import asdict

    from harness.config import EngineSettings

    spec = engine_spec(setting(FULL, PAGED, CEILING), PAGED, [[1, 2]], "/m")
    assert spec["engine"] == asdict(EngineSettings(
        device="cpu", block_size=32, kv_cache_gib=4.0, num_kv_blocks=17, threads=None, enforce_eager=True,
        async_scheduling=None, max_num_seqs=4, max_num_batched_tokens=8192, in_process=True, tensor_parallel_size=1,
        distributed_executor_backend=None, layer_groups=1, gpu_memory_utilization=None))
    assert engine_spec(setting(FULL, CEILING), CEILING, [[1]], "/m")["engine"]["num_kv_blocks"] == 65


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
        "trials range -1.00% to +1.00%; 95% interval -2.46% to +2.51%; target within 2%): equivalent"
    ]
    compiled = pd.DataFrame([{"policy.name": p, "trial": t, "output_tok_s": v * 1.5, "pool": "unlimited",
                              "enforce_eager": False} for p, t, v in rows])
    both = pd.concat([table.assign(enforce_eager=True), compiled])
    lines = overhead_lines(both)
    assert lines[1].startswith("compiled mode: patched engine, eviction off, vs stock vLLM: +0.00% output tok/s")
    assert lines[2].startswith("patched engine in eager mode (eviction off) vs stock vLLM at the platform's defaults "
                               "(compiled): -33.33% output tok/s (median of 3")
    assert lines[2].endswith("; 95% interval -34.97% to -31.66%): worse")
    (one,) = overhead_lines(table[table["trial"] == 1])
    assert one == ("patched engine, eviction off, vs stock vLLM: +1.00% output tok/s (median of 1 back-to-back trial; "
                   "target within 2%): no verdict")
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
    assert lines[0] == "paged b512 over 2 trials: 2.00x full cache (2.00-2.00): better"
    # snapkv: 0.75x paged in both trials although the machine ran at half speed in trial 2;
    # shares 11% and 21%: mean 16, t(1) x sd/sqrt(2) = 12.706 x 5 = 63.5 (a share: no verdict word)
    assert lines[1] == ("snapkv b512 over 2 trials: 1.50x full cache (1.50-1.50): better; 0.75x PagedEviction "
                        "(0.75-0.75): worse; eviction + capture 16.00% of model step time (0.00-79.53)")
    assert len(lines) == 2


def test_each_ratio_is_judged_at_the_margin_stated_before_the_run():
    """Issue 65: the word after a ratio is ``ratio_verdict``'s at ``THROUGHPUT_MARGIN`` (5%: equivalent
    inside (0.95x, 1/0.95x)), on the side the measure is worse; a ratio from one trial has no
    interval and decides nothing."""
    from harness.analysis.stats import Interval
    from harness.analysis.studies import THROUGHPUT_MARGIN
    from harness.analysis.verdicts import ratio_word, trials_verdict

    assert THROUGHPUT_MARGIN == 0.05
    assert ratio_word(Interval(1.2, 1.1, 1.3, 4)) == "better"  # the interval lies above 1
    assert ratio_word(Interval(1.2, 1.1, 1.3, 4), higher_is_better=False) == "worse"  # seconds, not tok/s
    assert ratio_word(Interval(0.9, 0.85, 0.97, 4)) == "worse"
    assert ratio_word(Interval(1.0, 0.955, 1.05, 4)) == "equivalent"  # straddles 1, both bounds inside the margin
    assert ratio_word(Interval(1.03, 0.96, 1.10, 4)) == "non-inferior"  # only the worse side inside
    assert ratio_word(Interval(1.0, 0.945, 1.05, 4)) == "inconclusive"  # its worse side leaves the margin ...
    # ... unless lower is better: then its worse side is the upper bound, inside the margin
    assert ratio_word(Interval(1.0, 0.945, 1.05, 4), higher_is_better=False) == "non-inferior"
    assert ratio_word(Interval(1.0, 0.9, 1.1, 4)) == "inconclusive"
    assert trials_verdict([0.99, 1.01, 1.0, 1.0]) == "equivalent"  # (0.987, 1.013)
    assert trials_verdict([0.8, 0.8]) == "worse" and trials_verdict([0.8, 0.8], higher_is_better=False) == "better"
    assert trials_verdict([1.2]) == "no verdict"


def test_a_configuration_measured_in_one_trial_gets_no_verdict():
    from harness.bench.throughput import cell_table, headline

    s = setting(FULL, PAGED, CEILING)
    table = cell_table(s, {cell: fake_cell(s, cell, 12.0 if cell.policy == "paged" else 10.0) for cell in s.cells})
    assert ("paged b64 / fixed pool: 12.0 tok/s = 1.20x full / fixed pool, 1.20x full / unlimited pool (one trial): "
            "no verdict") in headline(s, table)


@pytest.mark.parametrize("name, pattern, compared", [
    ("cpu", r"- {} over \d+ trials: [\d.]+x full cache \([\d.-]+\): ([a-z -]+?)(?:;|$)", 9),
    ("budget_schedules", r"- {} over \d+ trials: [\d.]+x PagedEviction \([\d.-]+\): ([a-z -]+?)(?:;|$)", 1),
    ("reconstruction", r"- {}: [^\n]*? the prefill seconds of full cache: ([a-z -]+?)(?:;|$)", 2),
], ids=["cpu", "budget_schedules", "reconstruction"])
def test_a_summary_gives_each_ratio_the_word_results_md_gives_it(tmp_path, capsys, name, pattern, compared):
    """The committed cells summarized again (no engine): each configuration's ratio to the setting's
    baseline over its trials carries the word RESULTS.md's table gives it
    (``harness.analysis.report.throughput_section``): one function, one margin, one interval. The
    prefill setting's word is the other way round (fewer seconds are better)."""
    import re
    import shutil

    from harness.analysis.report import throughput_section

    folder = tmp_path / "results" / "throughput" / name
    shutil.copytree(ROOT / "results" / "throughput" / name / "cells", folder / "cells")
    assert experiment.main([name, "--trials", "4", "--summary-only", "--out", str(folder)]) == 0
    capsys.readouterr()
    summary = (folder / "summary.md").read_text()
    rows = [[part.strip() for part in row.split("|")[1:-1]] for row in throughput_section(name, tmp_path)
            if row.startswith("| ") and not row.startswith("| cell |")]
    words = {}
    for base, _, _, word, *_ in rows:
        found = re.search(pattern.format(re.escape(base.split(" / ")[0])), summary, re.MULTILINE)
        if found:
            words[base] = (found.group(1), word)
    assert len(words) == compared, words
    assert all(ours == theirs for ours, theirs in words.values()), words
    assert {ours for ours, _ in words.values()} <= {"better", "worse", "equivalent", "non-inferior", "inconclusive"}


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


def gemma3_where_prepared(workload, tmp_path):
    """``workload`` as it is, or, for Gemma where it is not prepared (CI's clean machine: the bench
    would refuse it), on a folder holding Gemma's config.json (``test_hybrid_memory.GEMMA3``, its
    shape as docs/models.md gives it), which is all a pool's count reads."""
    import json

    from harness.config.models import GEMMA3, cache_dir, is_complete
    from tests.unit.test_hybrid_memory import GEMMA3 as GEMMA3_CONFIG

    if workload.model != f"embedded:{GEMMA3}" or is_complete(cache_dir() / "models" / GEMMA3):
        return workload
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_CONFIG))
    return replace(workload, model=str(tmp_path))


def test_every_shipped_setting_is_valid(tmp_path):
    """Gemma's setting on Gemma's config.json where Gemma is not prepared (CI): its pool is counted
    from the config (test_the_cpu_setting_on_gemmas_shape)."""
    for s in experiment.SETTINGS.values():
        s = replace(s, workload=gemma3_where_prepared(s.workload, tmp_path))
        check_setting(s)
        assert s.baseline in s.cells and (s.ceiling is None or s.ceiling in s.cells), s.name


def test_every_setting_measures_its_own_configurations():
    """Two settings with the same cells on the same workload measure one thing twice under two
    names (a pool sized differently aside): `overhead` once ran group_overhead's PagedEviction cells
    (a module constant reused) while its description and FINDINGS spoke of stock vLLM."""
    seen = {}
    for s in experiment.SETTINGS.values():
        key = (s.workload, frozenset(replace(cell, trial=1) for cell in s.cells))
        assert key not in seen, f"{s.name} runs the same cells on the same workload as {seen.get(key)}"
        seen[key] = s.name
    overhead = experiment.SETTINGS["overhead"].cells
    assert {cell.stock for cell in overhead} == {True, False}
    assert {cell.policy for cell in overhead} == {"full"}


def test_the_gpu_setting_is_refused_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        experiment.main(["paper"])
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_the_recomputation_floor_is_the_window_attention_over_the_steps_flops():
    from harness.config.models import ModelShape
    from harness.bench.throughput import LLAMA_31_8B, recompute_share

    # One layer, one head of dim 1, 10 parameters: a window of 2 queries over 4 cached keys costs
    # 2 x (2 x 4) = 16 FLOPs; each of the 4 steps between evictions 2 x 10 + 2 x (2 x 4) = 36.
    assert recompute_share(ModelShape(1, 1, 1, 1, 4), 10, window=2, cached=4, block=4) == pytest.approx(16 / (4 * 36))
    # The paper's model spends under 1% of its decode FLOPs on SnapKV's window at budget 512.
    assert recompute_share(*LLAMA_31_8B, window=32, cached=544, block=32) < 0.01


def test_the_trials_line_reads_the_cells_not_the_description():
    """The attention setting's description once said four policies ran three trials and "the rest
    once" when every one had run three: the summary now counts trials from the cells."""
    from harness.bench.throughput import trials_text

    every = pd.DataFrame([{"cell": f"{p} / fixed pool" + (f" #{t}" if t > 1 else ""), "trial": t, "repeats": 1}
                          for t in (1, 2, 3) for p in ("full", "paged b512", "knorm b512")])
    assert trials_text(every) == (
        "Trials: each of the 3 configurations ran in 3 trials (9 cells, an engine process each; trial k ran its "
        "configurations once each, in the table's order, after trial k - 1).")
    some = every[(every["trial"] == 1) | ~every["cell"].str.startswith("knorm")].assign(repeats=3)
    assert trials_text(some) == (
        "Trials: full / fixed pool, paged b512 / fixed pool ran in 3 trials; knorm b512 / fixed pool ran once "
        "(7 cells, an engine process each; trial k ran its configurations once each, in the table's order, after "
        "trial k - 1; each process generated the batch 3 times, medians reported).")
    assert trials_text(every[every["trial"] == 1]) == (
        "Trials: each of the 3 configurations ran once (3 cells, an engine process each).")
    assert "the rest once" not in experiment.SETTINGS["attention"].purpose


def fake_cell(setting, cell, tok_s: float) -> dict:
    """A stored cell as run_setting writes it, with the fields the report reads."""
    from dataclasses import asdict

    perf = {"output_tokens_per_s": tok_s, "total_tokens_per_s": 2 * tok_s, "wall_s": 10.0,
            "tpot_s": {"p50": 0.01}, "ttft_s": {"p50": 0.5}, "latency_s": {"p90": 2.0}, "preemptions": 0,
            "kv": {"evict_share_of_step": 0.01 if cell.policy != "full" else 0.0}, "ranks": []}
    return {"setting": setting.name, "cell": asdict(cell), "workload": asdict(setting.workload), "provenance": {},
            "pool_blocks": 10, "perf": [perf] * cell.repeats}


def test_a_summary_is_rewritten_from_the_cells_on_disk_alone(tmp_path, capsys):
    """--summary-only starts no engine: the table comes from cells/*.json, the summary names the
    command that measured them, and a missing or foreign cell is refused, not skipped."""
    import json

    from harness.bench.throughput import summarize_setting

    setting = experiment.with_trials(experiment.SETTINGS["latency"], 2)
    (tmp_path / "cells").mkdir()
    for cell in setting.cells:
        stored = fake_cell(setting, cell, 10.0 if cell.policy == "full" else 12.0)
        (tmp_path / "cells" / f"{cell.slug}.json").write_text(json.dumps(stored))
    table = summarize_setting(setting, tmp_path)
    assert list(table["cell"]) == [cell.name for cell in setting.cells]
    assert list(table["x_baseline"]) == pytest.approx([1.0, 1.2, 1.0, 1.2])
    assert experiment.main(["latency", "--trials", "2", "--summary-only", "--out", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "Command: `python experiments/throughput.py latency --trials 2 --out " in summary
    assert "--summary-only" not in summary
    assert ("Output layer of embedded:smollm2-135m-instruct (the input embedding, tied, 49152 x 576): 28.3M of the "
            "134.5M weights a decode step multiplies by (its parameters), 21.0% of the step's weight matmul FLOPs") in summary
    assert ("Trials: each of the 2 configurations ran in 2 trials (4 cells, an engine process each; trial k ran its "
            "configurations once each, in the table's order, after trial k - 1; each process generated the batch 3 "
            "times, medians reported).") in summary
    # Issue 65: the design, before the table: its test, its margin, whether it can decide.
    design = summary[summary.index("Design:"):summary.index("| cell")]
    assert max(len(line) for line in design.splitlines()) <= 110, "wrapped to read in a terminal"
    design = " ".join(design.split())
    assert "95% t-interval on their logs (`harness.analysis.stats.ratio_interval`)" in design
    assert "the drift model's own 95% interval (`harness.analysis.stats.trend_ratios`)" in design
    assert "at a margin of 5% (`harness.analysis.studies.THROUGHPUT_MARGIN`" in design
    assert "(better: more output tok/s, less time per output token)" in design
    assert "- Smallest p this design can reach: no floor above 0" in design
    assert "with 2 or more trials it can decide" in design
    assert "one trial has no interval and gets `no verdict`" in design
    # 1.2x in both trials, the trend fitted out: the interval lies above 1
    assert ("paged b1024 / unlimited pool vs full / unlimited pool, the trend taken out: 1.200x output tok/s (95% "
            "interval 1.200-1.200): better") in summary
    # The setting's own trials (one) do not match the cells of two: refused, naming the extra ones.
    with pytest.raises(ValueError, match="does not name .*trial-2"):
        summarize_setting(experiment.SETTINGS["latency"], tmp_path)
    next((tmp_path / "cells").glob("*trial-2.json")).unlink()
    with pytest.raises(ValueError, match="not measured on this workload"):
        summarize_setting(setting, tmp_path)
    capsys.readouterr()
    assert experiment.main(["latency", "--trials", "2", "--summary-only", "--out", str(tmp_path)]) == 2
    assert "not measured" in capsys.readouterr().err


def test_layer_groups_are_stated_against_one_group_trial_by_trial():
    """G > 1 against G = 1 of the same trial, as a geometric mean with its interval (a ratio of 0.9
    in every trial is 0.9 with no spread)."""
    import pandas as pd

    from harness.bench.throughput import layer_group_lines

    rows = [{"policy.name": "full", "budget": None, "pool": "unlimited", "tensor_parallel_size": 1, "trial": trial,
             "layer_groups": groups, "output_tok_s": speed * (0.9 if groups == 3 else 1.0),
             "tpot_p50_ms": 100 / speed / (0.9 if groups == 3 else 1.0)}
            for trial, speed in ((1, 80.0), (2, 70.0)) for groups in (1, 3)]
    (line,) = layer_group_lines(pd.DataFrame(rows))
    # 0.9x the output tok/s is worse; 1.11x the time per output token too (less is better there)
    assert line == ("full with G=3 layer groups vs one, over 2 back-to-back trials: 0.900x output tok/s (95% interval "
                    "0.900-0.900): worse; 1.111x time per output token (95% interval 1.111-1.111): worse")
    (once,) = layer_group_lines(pd.DataFrame([row for row in rows if row["trial"] == 1]))
    assert once.endswith("over 1 back-to-back trial: 0.900x output tok/s (one trial): no verdict; 1.111x time per "
                         "output token (one trial): no verdict")
    assert layer_group_lines(pd.DataFrame([row for row in rows if row["layer_groups"] == 1])) == []


def test_trials_run_in_counterbalanced_order():
    """Odd trials run the setting's order, even ones its reverse (issue 51: with one fixed order the
    configuration run last absorbs the machine's slowing down); the summary says so."""
    from harness.bench.throughput import order_text, run_order

    setting = experiment.with_trials(experiment.SETTINGS["layer_groups"], 3)
    names = [(cell.trial, cell.layer_groups) for cell in run_order(setting.cells)]
    assert names == [(1, 1), (1, 3), (1, 6), (2, 6), (2, 3), (2, 1), (3, 1), (3, 3), (3, 6)]
    table = pd.DataFrame({"cell": [c.name for c in setting.cells], "trial": [c.trial for c in setting.cells],
                          "position": [run_order(setting.cells).index(c) + 1 for c in setting.cells]})
    assert order_text(table) == "in the table's order (reversed in trial 2)"
    assert order_text(table.assign(position=range(1, 10))) == "in the table's order"


def test_drift_is_fitted_apart_from_the_configurations():
    """A machine slowing by 2% per cell, run in one fixed order: trial-by-trial ratios charge the
    later configurations with the drift, the fit with a time trend recovers the true ratios."""
    import numpy as np

    from harness.analysis.stats import trend_ratios

    true = {"one": 1.0, "three": 1.0, "six": 0.97}
    order = [name for _ in range(3) for name in ("one", "three", "six")]
    noise = [0.004, -0.003, 0.002, -0.001, 0.003, -0.004, 0.001, 0.0, -0.002]
    values = [80 * true[name] * 0.98 ** position * np.exp(e) for position, (name, e) in enumerate(zip(order, noise))]
    fit = trend_ratios(values, order, list(range(9)), "one")
    assert fit["df"] == 5 and fit["drift"].estimate == pytest.approx(0.98, abs=0.002)
    assert fit["ratios"]["six"].estimate == pytest.approx(0.97, abs=0.01)
    assert fit["ratios"]["three"].low < 1 < fit["ratios"]["three"].high
    naive = np.mean([values[i + 2] / values[i] for i in (0, 3, 6)])  # same-trial ratio: drift included
    assert naive < 0.945
    assert trend_ratios(values[:4], order[:4], list(range(4)), "one") is None  # no residual degree of freedom


def test_a_setting_runs_on_another_model_by_its_conf_name(capsys):
    """--model swaps the workload's model and dtype for conf/model/<name>.yaml's (Gemma for the
    cross-model throughput), keeps every cell, and refuses an unknown name in one line."""
    cpu = experiment.SETTINGS["cpu"]
    gemma = experiment.with_model(cpu, "gemma3-270m")
    assert (gemma.workload.model, gemma.workload.dtype) == ("embedded:gemma3-270m", "float32")
    assert gemma.cells == cpu.cells and replace(gemma.workload, model=cpu.workload.model) == cpu.workload
    prefill = experiment.with_model(experiment.PREFILL_SETTINGS["reconstruction"], "tiny")
    assert prefill.contexts.model == "embedded:tiny-llama"
    with pytest.raises(SystemExit):
        experiment.main(["cpu", "--model", "nope", "--summary-only"])
    assert "--model nope: no conf/model/nope.yaml (the models: " in capsys.readouterr().err


def test_every_committed_cell_ran_on_the_pool_its_setting_sizes(tmp_path):
    """The pools of models without windows are what they were before the bench counted KV cache
    groups (one group of every layer, or ``layer_groups`` of them): every committed cell's pool
    (SmolLM2's, the tiny Llama's; vLLM's own count, its null block taken off) is the one its setting
    sizes now; Gemma's (six KV cache groups) too, counted from its config where it is not prepared."""
    import json

    from harness.bench.throughput import Workload

    cells = sorted((ROOT / "results" / "throughput").glob("*/cells/*.json"))
    checked = 0
    for path in cells:
        stored = json.loads(path.read_text())
        if stored.get("setting") not in experiment.SETTINGS:
            continue  # (the reconstruction setting's prefill cells size their own pool)
        workload = gemma3_where_prepared(Workload(**stored["workload"]), tmp_path)
        s = replace(experiment.SETTINGS[stored["setting"]], workload=workload)
        assert s.pool_blocks(Cell(**stored["cell"])) == stored["pool_blocks"], path
        checked += 1
    assert checked >= 200
    cpu, tight = experiment.SETTINGS["cpu"], experiment.SETTINGS["cpu_tight"]
    assert (cpu.pool_blocks(Cell()), cpu.pool_blocks(CEILING), tight.pool_blocks(Cell())) == (12 * 17, 12 * 36, 3 * 40)
    assert cpu.pool_split_text() is None and tight.fixed_pool_text() == "120 blocks: 3 requests at full length"


HYBRID = replace(TINY, model="embedded:tiny-gemma3")  # 512 tokens a request; windows of 32 on 4 of 6 layers


def test_a_hybrid_models_pool_holds_a_request_in_every_kv_cache_group():
    """The tiny hybrid model's layers are two sliding-window KV cache groups and one full-attention
    group over one pool: a request at full length holds, as vLLM counts it, every token's blocks in
    the full-attention group and its window plus the tokens one step may schedule (capped at its
    length) in each sliding-window group, not the one group's 16 blocks a model without windows holds."""
    from harness.config import engine_settings, in_flight_tokens
    from harness.config.models import model_shape, resolve_model_path

    shape = model_shape(resolve_model_path(HYBRID.model, prepare=False), HYBRID.dtype)
    counted = shape.kv_cache_groups(32).request_blocks(HYBRID.max_model_len, in_flight_tokens(engine_settings("cpu")))
    assert counted == (17, 17, 16)  # min(31 + 8192, 512) tokens over 16 blocks, + 1 for a window inside a block
    s = setting(FULL, PAGED, CEILING, workload=HYBRID)
    one = s.request_blocks(FULL)
    assert (one.full, one.sliding) == ((16,), (17, 17)) and one.total == sum(counted) == 50
    assert s.pool_blocks(FULL) == 50 and s.pool_blocks(CEILING) == 4 * 50
    assert engine_spec(s, PAGED, [[1]], "/m")["engine"]["num_kv_blocks"] == 51
    assert s.fixed_pool_text() == ("50 blocks: 1 requests at full length as vLLM counts a request, "
                                   "2.5 with full cache while generating")
    # While generating a sliding-window group holds its window and the newest token: 2 blocks, not 17.
    assert s.request_blocks(FULL, generating=True) == type(one)((16,), (2, 2))
    assert s.pool_split_text() == (
        "KV cache groups: 1 full-attention and 2 sliding-window over one block pool, a request holding blocks in "
        "each; blocks per request (full-attention + sliding-window groups): at full length as vLLM counts one when "
        "it sizes and checks its pool (a sliding-window group's window plus the 8192 tokens a step may schedule, at "
        "most the request's 512) 16 + 2 x 17 = 50; with full cache while generating (a sliding-window group's "
        "window and newest token) 16 + 2 x 2 = 20; at budget 64 3 + 2 x 2 = 7 (65% fewer than full cache). "
        "Eviction shrinks the full-attention groups only.")
    check_setting(s)


def test_a_pool_sized_at_a_budget_on_a_hybrid_model_keeps_the_windows():
    """At a budget, eviction keeps a request to budget // block + 1 blocks in the full-attention group
    only; each sliding-window group holds what vLLM keeps there while generating, whatever the policy.
    On Gemma 3 270M's shape: test_the_cpu_setting_on_gemmas_shape."""
    s = Setting("tiny", "test", replace(HYBRID, requests=8), (FULL, PAGED, CEILING), fixed_pool_budget=64)
    check_setting(s)
    assert s.request_blocks(PAGED, budget=64) == type(s.request_blocks(FULL))((3,), (2, 2))
    assert s.pool_blocks(FULL) == 8 * 7 and s.pool_blocks(CEILING) == 8 * 50
    assert s.fixed_pool_text() == ("56 blocks: every request at budget 64 (7 blocks each), 1.1 at full length as "
                                   "vLLM counts a request, 2.8 with full cache while generating")


def test_the_cpu_setting_on_gemmas_shape(tmp_path):
    """`--model gemma3-270m`'s cpu setting, on Gemma 3 270M's config.json (CI has no Gemma): every
    request at budget 512 holds 17 blocks in the global group and 17 in each of the five local ones
    (what a run at budget 512 held: docs/models.md)."""
    import json

    from tests.unit.test_hybrid_memory import GEMMA3

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
    cpu, named = experiment.SETTINGS["cpu"], experiment.SETTINGS["cpu_gemma3"]
    # the committed study's setting (harness.analysis.studies) is cpu on Gemma, nothing else changed
    assert (named.cells, named.fixed_pool_budget, replace(named.workload, model=cpu.workload.model)) == (
        cpu.cells, cpu.fixed_pool_budget, cpu.workload)
    assert named.workload.model == "embedded:gemma3-270m" == experiment.with_model(cpu, "gemma3-270m").workload.model
    gemma = replace(named, workload=replace(named.workload, model=str(tmp_path)))
    check_setting(gemma)
    assert gemma.pool_blocks(FULL) == 12 * (17 + 5 * 17) and gemma.pool_blocks(CEILING) == 12 * (36 + 5 * 37)
    assert gemma.fixed_pool_text() == ("1224 blocks: every request at budget 512 (102 blocks each), 5.5 at full "
                                       "length as vLLM counts a request, 10.1 with full cache while generating")
    split = gemma.pool_split_text()
    assert "1 full-attention and 5 sliding-window" in split and "36 + 5 x 37 = 221" in split
    assert "with full cache while generating (a sliding-window group's window and newest token) 36 + 5 x 17 = 121; " \
           "at budget 256 9 + 5 x 17 = 94 (22% fewer than full cache); at budget 512 17 + 5 x 17 = 102 (16% fewer " \
           "than full cache); at budget 1024 33 + 5 x 17 = 118 (2% fewer than full cache)" in split


def test_a_pool_too_small_for_one_hybrid_request_is_refused():
    """vLLM refuses a pool that cannot hold one request in all its groups; so does the check, where
    the one group's count (16 blocks) would have let this 36-block pool through."""
    s = Setting("tiny", "test", HYBRID, (FULL, PAGED), fixed_pool_budget=128)
    assert s.pool_blocks(FULL) == 4 * (5 + 2 * 2) == 36
    with pytest.raises(ValueError, match=r"a 36-block pool cannot hold one request of 50 blocks "
                                         r"\(16 \+ 2 x 17: full-attention \+ sliding-window groups\)"):
        check_setting(s)
    with pytest.raises(ValueError, match="a 12-block pool cannot hold one request of 16 blocks$"):
        check_setting(Setting("tiny", "test", TINY, (FULL,), fixed_pool_budget=64))  # without windows, as before


def test_a_model_not_prepared_is_not_sized_as_one_group(tmp_path, monkeypatch):
    """Gemma 3 before its first use has no config.json to count its groups from: the setting is
    refused (run_setting prepares the model before it checks), never sized as one group of every
    layer; a hub id, which the harness does not read, keeps the one-group count."""
    monkeypatch.setenv("KVH_CACHE", str(tmp_path))
    gemma = experiment.with_model(experiment.SETTINGS["cpu"], "gemma3-270m")
    with pytest.raises(ValueError, match="cpu: the KV pool of embedded:gemma3-270m is counted from its config.json: "
                                         "embedded model gemma3-270m is not prepared: run ./setup.sh gemma3-270m"):
        check_setting(gemma)
    hub = setting(FULL, CEILING, workload=replace(TINY, model="meta-llama/Llama-3.2-1B-Instruct"))
    assert hub.pool_blocks(FULL) == 16 and hub.pool_blocks(CEILING) == 64 and hub.pool_split_text() is None
    assert hub.pool_blocks(Cell("full", layer_groups=3)) == 48


def test_the_output_layers_share_of_a_decode_step(tmp_path):
    """A tied embedding is the output layer's matrix (the checkpoint stores it once); an untied
    input embedding is a lookup, not multiplied by."""
    import torch
    from safetensors.torch import save_file

    from harness.bench.throughput import output_layer, output_layer_line

    weights = {"model.embed_tokens.weight": torch.zeros(10, 4), "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4),
               "model.norm.weight": torch.zeros(4)}
    tied, untied = tmp_path / "tied", tmp_path / "untied"
    tied.mkdir(), untied.mkdir()
    save_file(weights, str(tied / "model.safetensors"))
    save_file({**weights, "lm_head.weight": torch.zeros(10, 4)}, str(untied / "model.safetensors"))
    one, other = output_layer(str(tied)), output_layer(str(untied))
    assert (one.shape, one.tied, one.parameters, one.multiplied) == ((10, 4), True, 60, 60)
    assert (other.shape, other.tied, other.parameters, other.multiplied) == ((10, 4), False, 100, 60)
    assert one.share == other.share == pytest.approx(40 / 60)
    assert output_layer(str(tmp_path)) is None  # no checkpoint
    line = output_layer_line(setting(FULL, workload=replace(TINY, model=str(untied))))
    assert line == ("Output layer of untied (lm_head, 10 x 4): 0.0M of the 0.0M weights a decode step multiplies by "
                    "(its parameters less the input embedding, a lookup), 66.7% of the step's weight matmul FLOPs: "
                    "the vocabulary's logits, whatever the cache holds.")
    # The tiny Llama ties its 49,152 x 256 embedding: 12.6M of its 14.9M parameters.
    assert "(the input embedding, tied, 49152 x 256): 12.6M of the 14.9M weights" in output_layer_line(setting(FULL))


def test_a_hybrid_models_summary_says_how_its_pool_splits(tmp_path):
    import json

    from harness.bench.throughput import summarize_setting, write_report

    s = setting(FULL, PAGED, CEILING, workload=HYBRID)
    (tmp_path / "cells").mkdir()
    for cell in s.cells:
        (tmp_path / "cells" / f"{cell.slug}.json").write_text(json.dumps(fake_cell(s, cell, 10.0)))
    report = write_report(s, summarize_setting(s, tmp_path), tmp_path, "python experiments/throughput.py tiny")
    assert ("Fixed pool: 50 blocks: 1 requests at full length as vLLM counts a request, 2.5 with full cache while "
            "generating; unlimited pool: 200 blocks (every request at full length).\nKV cache groups: 1 full-attention "
            "and 2 sliding-window over one block pool") in report
    assert "Output layer of embedded:tiny-gemma3 (lm_head, 49152 x 256): 12.6M of the 16.1M weights" in report


def test_a_summary_rewritten_from_its_cells_keeps_the_command_that_measured_them(tmp_path):
    """--summary-only cannot be typed beside --force, so the summary's Command line is the one
    already there (the command that measured the cells), not the re-render's own argv."""
    summary = tmp_path / "summary.md"
    assert experiment.measured_command(summary) is None
    summary.write_text("# Throughput: cpu\n\npurpose\n\nCommand: `python experiments/throughput.py cpu --trials 4 --force`\n")
    assert experiment.measured_command(summary) == "python experiments/throughput.py cpu --trials 4 --force"
    summary.write_text("# Throughput: cpu\n\nCommand: `python experiments/other.py cpu`\n")
    assert experiment.measured_command(summary) is None

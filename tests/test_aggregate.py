"""Aggregation, plots and the notebook over the committed CI baseline results (no engine)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harness.aggregate import load_runs, main as aggregate_main, score_table, system_table
from policies import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
CI_BASELINE = ROOT / "results" / "ci_baseline"
SWEPT = sorted(name for name, entry in REGISTRY.items() if entry.alias_of is None)  # the CI sweep's policies
CELLS = 1 + 2 * (len(SWEPT) - 1)  # full cache once, every other policy at two budgets


@pytest.fixture(scope="module")
def frame():
    return load_runs([CI_BASELINE])


def test_one_row_per_run_and_task_with_every_config_key(frame):
    assert frame["run_dir"].nunique() == CELLS
    assert {"policy.name", "budget", "model.name", "data.name", "block_size", "engine.device", "policy.options.n_sink"} <= set(frame.columns)
    assert set(frame["task"]) == {"single_doc_qa", "key_retrieval", "code_completion"}
    full = frame[frame["policy.name"] == "full"]
    assert full["budget"].isna().all(), "full cache has no budget"
    assert ((full["retention_pct"] == 100) | full["retention_pct"].isna()).all()
    assert (full["throughput_vs_full"] == 1).all()
    evicting = frame[frame["policy.name"] != "full"]
    assert evicting["fidelity_exact_match"].notna().all(), "fidelity to full cache for every non-full run"
    assert (evicting["kv_blocks_peak"] <= full["kv_blocks_peak"].max()).all(), "eviction never holds more KV"


def test_score_table_is_policy_by_budget(frame):
    table = score_table(frame)
    assert list(table.index) == [("full", "all")] + [(name, budget) for name in SWEPT if name != "full"
                                                     for budget in ("256", "512")]
    assert list(table.columns) == ["code_completion", "key_retrieval", "single_doc_qa", "average"]


def test_tables_read_full_cache_first_and_budgets_in_numeric_order():
    cpu_sweep = load_runs([ROOT / "results" / "cpu_accuracy"])  # budgets 256, 512, 1024
    for table in (score_table(cpu_sweep), system_table(cpu_sweep)):
        rows = list(table.index)
        assert rows[0] == ("full", "all")
        assert rows[1:4] == [("h2o", "256"), ("h2o", "512"), ("h2o", "1024")]  # alphabetical, then by budget
    retention = system_table(cpu_sweep)["retention_avg_pct"]
    averages = score_table(cpu_sweep)["average"]
    assert retention[("full", "all")] == 100
    for row in [("paged", "256"), ("streaming", "1024")]:
        assert retention[row] == pytest.approx(100 * averages[row] / averages[("full", "all")], abs=0.1)


def test_cli_writes_summary_and_plots(tmp_path, capsys):
    assert aggregate_main([str(CI_BASELINE), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "summary.csv").read_text().count("\n") == CELLS * 3 + 1
    markdown = (tmp_path / "summary.md").read_text()
    assert "Produced by `python -m harness.aggregate" in markdown and re.search(r"\| paged +\| 256 +\|", markdown)
    for kind in ("score_vs_budget", "throughput", "tradeoff"):
        for ext in ("png", "pdf"):
            assert (tmp_path / f"smollm2-135m_synthetic_{kind}.{ext}").stat().st_size > 5000
    assert "## smollm2-135m on synthetic" in capsys.readouterr().out


def test_notebook_runs_top_to_bottom():
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    os.environ["KVH_ROOT"] = str(ROOT)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2, "the plots are drawn"


def test_an_interval_recomputed_from_the_per_sample_scores_matches(frame):
    """The documented bootstrap, written out with numpy: per task in sorted order, 2000 resamples
    from one generator seeded 0; the average resamples within tasks."""
    import json

    import numpy as np

    run = frame[(frame["policy.name"] == "paged") & (frame["budget"] == 512)]
    rows = [json.loads(line) for line in (Path(run["run_dir"].iloc[0]) / "predictions.jsonl").read_text().splitlines()]
    rng = np.random.default_rng(0)
    draws = {}
    for task in sorted({r["task"] for r in rows}):
        scores = np.array([r["score"] for r in rows if r["task"] == task])
        draws[task] = 100 * scores[rng.integers(0, len(scores), size=(2000, len(scores)))].mean(axis=1)
    task = "single_doc_qa"
    row = run[run["task"] == task].iloc[0]
    assert (row["score_low"], row["score_high"]) == tuple(np.percentile(draws[task], [2.5, 97.5]).round(2))
    average = np.mean(list(draws.values()), axis=0)
    assert (row["average_low"], row["average_high"]) == tuple(np.percentile(average, [2.5, 97.5]).round(2))
    assert row["score_low"] <= row["score"] <= row["score_high"]


def test_every_score_and_paired_difference_has_its_interval(frame):
    assert frame[["score_low", "score_high", "average_low", "average_high"]].notna().all().all()
    evicting = frame[frame["policy.name"] != "full"]
    for column in ("vs_full_diff", "vs_full_low", "vs_full_high", "avg_vs_full_diff", "avg_vs_full_low", "avg_vs_full_high"):
        assert evicting[column].notna().all(), column
    paged = evicting[evicting["policy.name"] == "paged"]
    assert paged[["avg_vs_streaming_diff", "avg_vs_knorm_low", "avg_vs_keydiff_high"]].notna().all().all()
    # A paired difference is the difference of the two runs' scores on the same samples.
    for _, row in paged.iterrows():
        streaming = evicting[(evicting["policy.name"] == "streaming") & (evicting["budget"] == row["budget"])
                             & (evicting["task"] == row["task"])].iloc[0]
        assert row["vs_streaming_diff"] == pytest.approx(row["score"] - streaming["score"], abs=0.01)


def test_summary_marks_significant_differences(frame):
    from harness.aggregate import differences_table

    table = differences_table(frame)
    cells = [cell for cell in table.to_numpy().flatten() if cell]
    significant = [cell for cell in cells if cell.endswith("*")]
    assert significant and len(significant) < len(cells)
    for cell in significant:
        low, high = (float(x) for x in cell.split("(")[1].split(")")[0].split(","))
        assert low > 0 or high < 0


def test_variants_are_named_by_what_differs_from_their_defaults():
    from harness.aggregate import variant_label

    defaults = {"per_head": False, "candidates": "global", "local_blocks": 3, "score_layers": "all"}
    engine = {"block_size": 32}
    assert variant_label({"policy": {"name": "paged", "options": defaults}, "block_size": 32, "engine": engine}) == "paged"
    per_head = {"policy": {"name": "paged", "options": dict(defaults, per_head=True)}, "block_size": 64, "engine": engine}
    assert variant_label(per_head) == "paged[per_head=True, block_size=64]"
    assert variant_label({"policy": {"name": "knorm", "options": {"per_head": True}}, "engine": engine}) == "knorm"
    assert variant_label({"policy": {"name": "full", "options": {}}, "block_size": 32, "engine": engine}) == "full"

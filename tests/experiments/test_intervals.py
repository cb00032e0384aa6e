"""Every committed paired comparison's interval agrees with its own test (issue 51): it excludes
zero exactly when p < 0.05. Checked over every summary.csv and comparisons.csv under results/ (and
each served workload's accuracy.csv) by ``tests/support/recompute_intervals.py``, which shares no
code with ``harness/``; the same script recomputes a few committed intervals from the per-sample records."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.support import ROOT
from tests.support.recompute_intervals import comparisons, disagreements, recompute


def test_no_committed_interval_disagrees_with_its_p_value():
    total, found = disagreements(ROOT)
    assert total > 100_000, total  # every study's tables were read, not an empty walk
    assert found == [], f"{len(found)} of {total} disagree, e.g. {found[:5]}"


def test_the_walk_catches_a_planted_disagreement(tmp_path: Path):
    """The check can fail: an interval excluding zero beside p = 0.125 (the issue's ablation example,
    "+3.20 (+0.27, +8.64) p=0.1317", in miniature), and one containing zero beside p = 0.01."""
    folder = tmp_path / "results" / "study"
    folder.mkdir(parents=True)
    pd.DataFrame({"run_dir": ["a", "a", "b"], "task": ["x", "y", "x"],
                  "avg_vs_b_low": [0.27, 0.27, -1.0], "avg_vs_b_high": [8.64, 8.64, 1.0], "avg_vs_b_p": [0.125, 0.125, 0.5],
                  "vs_b_low": [-1.0, -2.0, -1.0], "vs_b_high": [1.0, 2.0, 1.0], "vs_b_p": [0.5, 0.01, 0.5]}
                 ).to_csv(folder / "summary.csv", index=False)
    pd.DataFrame({"row": ["c"], "column": ["d"], "low": [0.5], "high": [3.0], "p": [0.2]}).to_csv(
        folder / "comparisons.csv", index=False)
    served = tmp_path / "results" / "serving" / "workload"  # a served workload's accuracy.csv: full cache has no comparison
    served.mkdir(parents=True)
    pd.DataFrame({"configuration": ["full", "paged context"], "vs_full": [None, -30.0], "vs_full_low": [None, -57.5],
                  "vs_full_high": [None, -12.5], "p": [None, 0.06]}).to_csv(served / "accuracy.csv", index=False)
    total, found = disagreements(tmp_path)
    assert total == 2 + 3 + 1 + 1  # the average once per run, each task row, the comparisons.csv row, the served one
    assert len(found) == 4 and "accuracy.csv" in found[0] and "vs_full" in found[0], found
    assert "avg_vs_b" in found[2] and " y vs_b" in found[3] and "comparisons.csv" in found[1], found


@pytest.mark.parametrize("folder, field, variant, budget, other, task", [
    pytest.param("results/layer_budgets_suite", "score", "paged[layer_groups=3, budget_schedule=attention]", "512",
                 "paged[layer_groups=3]", None, marks=pytest.mark.slow),    # 40 samples: exact (about 10 s)
    ("results/cpu_accuracy", "score", "paged", "256", "knorm", "single_doc_qa"),  # one task, 20 samples: exact
    ("results/cpu_accuracy", "score", "paged", "512", "streaming", None),          # 80 samples: random patterns
    pytest.param("results/ruler", "answer_logprob", "paged[decode_eviction=False]", "r0.5", "snapkv[decode_eviction=False]",
                 None, marks=pytest.mark.slow),
])
def test_the_committed_intervals_are_recomputed_without_harness_code(folder, field, variant, budget, other, task):
    """The recomputation's bounds equal the committed ones where both are exact (to the kept
    decimals) and lie within the Monte Carlo error of both where patterns are drawn."""
    result = recompute(ROOT / folder, field, variant, budget, other, task)
    diff, low, high, mc, p = result["committed"]
    mine = result["recomputed"]
    assert mine[0] == pytest.approx(diff, abs=0.006 if field != "answer_logprob" else 6e-5)
    if mc == 0:
        assert mine[3] == pytest.approx(p, rel=1e-9)
    # Both sides' Monte Carlo error (the recomputation's 400,000 patterns add well under the committed
    # bound's) and the last kept digit (2 decimals on the 0-100 scale, 4 in nats).
    tolerance = 5 * mc + (2e-4 if field == "answer_logprob" else 0.011)
    assert abs(mine[1] - low) <= tolerance and abs(mine[2] - high) <= tolerance, (result, tolerance)
    assert (low > 0 or high < 0) == (p < 0.05)


def test_a_comparisons_csv_is_read_with_its_bare_columns():
    frame = pd.DataFrame({"low": [1.0], "high": [2.0], "p": [0.01], "other_low": [np.nan]})
    assert comparisons(frame) == [(0, "")]

"""CI regression of accuracy numbers: rerun the fixed configuration, compare with results/reference.

Regenerate the reference on purpose (and commit it) with:
    python run.py -m +experiment=ci_regression output_dir=results/reference force=true
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.aggregate import load_runs

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 5.0  # points on LongBench's 0-100 scale, per (policy, budget, task) cell
pytestmark = pytest.mark.engine


def scores(root: Path) -> dict:
    frame = load_runs([root])
    return {
        (row["policy.name"], None if row["budget"] != row["budget"] else int(row["budget"]), row["task"]): row["score"]
        for _, row in frame.iterrows()
    }


def test_scores_match_the_committed_reference(tmp_path):
    done = subprocess.run(
        [sys.executable, "run.py", "-m", "+experiment=ci_regression", f"output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=3600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "[sweep] 10/10 cells done (1 already complete)" in done.stdout, "full cache ran once"
    expected, measured = scores(ROOT / "results" / "reference"), scores(tmp_path)
    assert set(measured) == set(expected)
    moved = {cell: (expected[cell], measured[cell]) for cell in expected if abs(expected[cell] - measured[cell]) > TOLERANCE}
    assert not moved, f"scores moved beyond {TOLERANCE} points (reference, now): {moved}"

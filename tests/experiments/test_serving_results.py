"""The committed serving sweeps recompute at this code with no server: each ``results/serving/<sweep>``'s
summaries rebuilt from its saved runs (``experiments/serving.py --summary-only``, the first half of
``--verify``) equal the committed files byte for byte. A change to the serving summaries, the
workloads or their scoring that would move a committed figure fails here, before any engine runs."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted(path.parent for path in (ROOT / "results" / "serving").glob("*/settings.json"))


@pytest.mark.slow  # the tokenizer, every saved run scored again, the plot: seconds per sweep
@pytest.mark.parametrize("sweep", SWEEPS, ids=[sweep.name for sweep in SWEEPS])
def test_a_committed_sweeps_summaries_rebuild_from_its_saved_runs(sweep, tmp_path):
    from harness.serving.experiment import RECOMPUTED, summarize

    copy = tmp_path / sweep.name
    shutil.copytree(sweep, copy)
    summarize(copy)
    committed = [name for name in RECOMPUTED if (sweep / name).is_file()]
    assert "summary.md" in committed
    assert [name for name in committed if (copy / name).read_bytes() != (sweep / name).read_bytes()] == []

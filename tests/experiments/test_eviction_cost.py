"""The eviction microbenchmark measures what it says (a small case, this tree's evictor only), and its
summaries say they decide nothing and who measured and rendered them (issue 65, items 2 and 5)."""
from __future__ import annotations

import importlib.util
import json

import pandas as pd
import pytest

from harness.records.provenance import LOADED
from tests.support import ROOT


def load_benchmark():
    spec = importlib.util.spec_from_file_location("eviction_cost", ROOT / "experiments" / "eviction_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_steady_state_block_eviction_allocates_less_than_one_layer_of_the_request():
    """PagedEviction at budget 1024 on SmolLM2's shape: the measured peak of extra memory stays
    below one layer's K/V of the request (the old evictor copied every layer, in float32)."""
    benchmark = load_benchmark()
    case = dict(shape="smollm2-135m", policy="paged", phase="decode", budget=1024, tokens=1024 + benchmark.BLOCK)
    result = benchmark.run_case(case, ROOT)
    shape = benchmark.SHAPES["smollm2-135m"]
    one_layer = case["tokens"] * shape["heads"] * shape["dim"] * 2 * 4
    assert result["score_cache"] and result["evictor"].startswith(str(ROOT))
    assert 0 <= result["extra_bytes"] < one_layer, result


def test_the_peak_measurement_sees_a_temporary(tmp_path):
    """The VmHWM reading catches a 64 MiB temporary freed before it is read."""
    import os
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from pathlib import Path\nimport torch\nfrom eviction_cost import status_bytes\n"
        # torch's first fill starts its thread pool: warm it up so only the temporary is measured.
        "torch.ones(2**10).sum()\n"
        "Path('/proc/self/clear_refs').write_text('5'); before = status_bytes('VmHWM')\n"
        "t = torch.ones(16 * 2**20); del t\nprint(status_bytes('VmHWM') - before)\n"
    ) % str(ROOT / "experiments")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    assert done.returncode == 0, done.stderr
    assert 60 * 2**20 <= int(done.stdout.strip()) <= 70 * 2**20


def test_the_summary_says_first_that_one_measurement_decides_nothing():
    benchmark = load_benchmark()
    row = dict(shape="smollm2-135m", policy="paged", phase="decode", budget=1024, tokens=1040,
               before_bytes=3 * 2**20, after_bytes=2**20, before_s=0.02, after_s=0.01)
    lines = benchmark.report([row], "0c18297", "abc1234", "Measured at commit x.").splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert lines[2].startswith("**No verdict: one measurement per row, no interval.**")
    assert "Measured at commit x." in lines[4]


@pytest.mark.parametrize("repeats, could", [(3, "cannot decide anything, so none is run"),
                                            (10, "could decide, but none is run")])
def test_the_batch_summary_says_what_its_repeats_could_reach(repeats, could):
    """3 repeats: a sign-flip test's smallest p is 1/9 (0.111), so with 2 rows nothing could be decided;
    10 repeats could (1/1025 x 2 < 0.05), yet no test runs, so still no verdict."""
    benchmark = load_benchmark()
    rows = [dict(shape="smollm2-135m", view="cpu_attn", policy=policy, budget=512, requests=12, mode=mode, repeat=r,
                 extra_bytes=2**20, seconds=0.01, predicted_bytes=2**21)
            for policy in ("paged", "knorm") for mode in ("one", "together") for r in range(repeats)]
    lines = benchmark.batch_report(rows, repeats, "abc1234", "Measured at commit x.").splitlines()
    assert lines[2].startswith(f"**No verdict: medians of {repeats} interleaved repeats per row, no interval.**")
    assert could in lines[2] and ("p = 0.111" in lines[2]) == (repeats == 3)


def test_a_run_record_names_the_measuring_commit_and_summary_only_reads_it(tmp_path):
    """write_results keeps the run's record beside its CSV; --summary-only names its commit and code
    version as the measuring ones and this process's as the rendering ones."""
    benchmark = load_benchmark()
    row = dict(shape="smollm2-135m", policy="paged", phase="decode", budget=1024, tokens=1040,
               before_bytes=3 * 2**20, after_bytes=2**20, before_s=0.02, after_s=0.01)
    record = {"command": "python experiments/eviction_cost.py --before 0c18297", "before": "0c18297",
              "after": "abc1234", "provenance": {"git_commit": "abc1234" + "0" * 33, "code_version": "0123456789ab"}}
    benchmark.write_results(tmp_path, "summary", benchmark.report([row], "0c18297", "abc1234"), [row], record)
    assert json.loads((tmp_path / "summary_run.json").read_text()) == record
    benchmark.main(["--summary-only", "--data", str(tmp_path), "--out", str(tmp_path / "again")])
    text = (tmp_path / "again" / "summary.md").read_text()
    assert text.startswith("# One eviction's extra memory and time (before = 0c18297, after = abc1234)")
    assert (f"Measured at commit {'abc1234' + '0' * 33} (code version 0123456789ab); summary rendered at commit "
            f"{LOADED['git_commit']} (code version {LOADED['code_version']})") in text


def table_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("|")]


def test_the_committed_timings_rerender_as_measured_and_name_their_clean_code(tmp_path):
    """--summary-only over the committed CSVs and their run records: the tables are the committed
    ones, cell for cell; each names the commit and code version its run recorded (clean: the
    measuring code existed as committed, issue 65's provenance) and those that rendered it."""
    benchmark = load_benchmark()
    data = ROOT / "results" / "eviction_cost"
    benchmark.main(["--summary-only", "--out", str(tmp_path)])
    for name in ("summary", "batch"):
        committed = (data / f"{name}.md").read_text().splitlines()
        rendered = (tmp_path / f"{name}.md").read_text().splitlines()
        assert table_lines(rendered) == table_lines(committed) and rendered[0] == committed[0]
        assert rendered[2].startswith("**No verdict:")
        measured = json.loads((data / f"{name}_run.json").read_text())["provenance"]
        assert not measured["git_commit"].endswith("+dirty") and len(measured["code_version"]) == 12
        assert (f"Measured at commit {measured['git_commit']} (code version {measured['code_version']}); summary "
                f"rendered at commit {LOADED['git_commit']} (code version {LOADED['code_version']})") in "\n".join(rendered)
        assert len(pd.read_csv(data / f"{name}.csv")) > 0


def test_a_measuring_run_writes_its_provenance(tmp_path, monkeypatch):
    """One small case through main, before (BASELINE's evictor) and after (this tree's): the summary
    opens with its no-verdict line and names this process's commit and code version, and
    summary_run.json records them."""
    benchmark = load_benchmark()
    monkeypatch.setattr(benchmark, "CASES", [("smollm2-135m", "paged", "decode", 1024, 1024 + benchmark.BLOCK)])
    assert benchmark.main(["--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "summary_run.json").read_text())
    assert record["before"] == benchmark.BASELINE and record["after"] == LOADED["git_commit"][:7] + (
        "+dirty" if LOADED["git_commit"].endswith("+dirty") else "")
    assert {k: record["provenance"][k] for k in ("git_commit", "code_version")} == LOADED
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[2].startswith("**No verdict: one measurement per row, no interval.**")
    assert f"Measured and rendered at commit {LOADED['git_commit']} (code version {LOADED['code_version']})." in lines[4]

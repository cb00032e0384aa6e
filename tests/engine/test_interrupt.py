"""A sweep killed at any moment (SIGKILL, SIGTERM, SIGINT) leaves no file that looks complete, and
running the same sweep again redoes exactly the unfinished cells: the final results equal an
uninterrupted sweep's. One engine per cell (hydra/launcher=basic: SIGKILL, SIGTERM), and the default
shared-prefill launcher (SIGINT), where a killed group leaves none of its cells. Both launchers run
their cells through ``harness.run.group.run_group``, which abandons every cell under way on any
exception, KeyboardInterrupt included, so each signal is sent once here (CI time: a sweep start each)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.analysis.aggregate import load_runs, score_table
from harness.run.group import ENGINE_LOG
from harness.records.results import RUN_FILES
from tests.support import ROOT

pytestmark = pytest.mark.engine
# (no forced passes: no assertion here reads them, and they would add two rounds of requests per cell;
# two cells, one per signal the one-engine-per-cell sweep is killed by, and a group of two for the
# shared-prefill launcher: CI time, a third cell cost an engine start more in each one-engine-per-cell
# sweep)
SWEEP = ["-m", "model=tiny", "policy=full,paged", "budget=256", "data.limit=1",
         "data.tasks=[key_retrieval,code_completion]", "likelihood=false"]


def default_signals() -> None:
    """A sweep started from a terminal gets SIGINT's default disposition; one started under a
    non-interactive background shell inherits it ignored (Python then installs no KeyboardInterrupt
    handler), which would make Ctrl-C untestable. Give the sweep what a terminal user's has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sweep(out: Path, launcher: str = "basic", **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *SWEEP, f"hydra/launcher={launcher}", f"output_dir={out}"],
                            cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=default_signals, **popen)


def cells(out: Path) -> tuple[list[Path], list[Path]]:
    """(complete run directories, partial ones) under a sweep's output directory."""
    found = [p for p in out.glob("tiny/synthetic/*") if p.is_dir()]
    return [p for p in found if not p.name.endswith(".partial")], [p for p in found if p.name.endswith(".partial")]


def scores(out: Path):
    table = score_table(load_runs([out]))
    return table.sort_index(axis=0).sort_index(axis=1)


def kill_when(process: subprocess.Popen, out: Path, ready, sig) -> None:
    """Send ``sig`` to the sweep once ``ready(complete, partial)`` holds for its run directories,
    a second later (into the engine's start, ten seconds and more, not its end)."""
    deadline = time.time() + 900
    while time.time() < deadline:
        if ready(*cells(out)):
            time.sleep(1)
            break
        assert process.poll() is None, f"the sweep ended before it could be killed:\n{process.stdout.read()[-3000:]}"
        time.sleep(0.2)
    os.killpg(process.pid, sig)
    process.wait(timeout=120)
    assert process.returncode != 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    process = sweep(out)
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-3000:]
    assert len(cells(out)[0]) == 2
    return out


def test_a_sweep_killed_in_each_cell_resumes_to_the_same_results(tmp_path, uninterrupted):
    """One sweep killed twice, each rerun resuming the last: SIGKILL in the first cell, SIGTERM in
    the second (CI time: one chain runs each cell once, where separate kills ran a sweep each; the
    third signal, SIGINT, is test_a_killed_group_sweep_resumes_to_the_same_outputs's, a sweep start
    fewer). After each kill no cell under way looks complete; each rerun skips the finished cells,
    discards the half-written one and redoes it; the last one's scores equal the uninterrupted
    sweep's."""
    for sig, complete_before_kill in ((signal.SIGKILL, 0), (signal.SIGTERM, 1)):
        def engine_started(complete, partial):
            return len(complete) == complete_before_kill and partial and (partial[0] / ENGINE_LOG).exists()

        killed = sweep(tmp_path)
        kill_when(killed, tmp_path, engine_started, sig)
        output, _ = killed.communicate(timeout=120)  # (bounded: a survivor holding the pipe fails, never hangs)
        assert output.count("[skip]") == max(complete_before_kill - 1, 0), "finished cells are not redone"
        complete, partial = cells(tmp_path)
        assert len(complete) == complete_before_kill, f"{sig.name}: the cell under way did not publish"
        for run_dir in complete:
            assert sorted(p.name for p in run_dir.iterdir()) == sorted([*RUN_FILES, ENGINE_LOG]), f"{run_dir} looks complete"

    resumed = sweep(tmp_path)
    output, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, output[-3000:]
    assert output.count("[skip]") == 1, "finished cells are not redone"
    assert "2/2 cells done" in output
    complete, partial = cells(tmp_path)
    assert len(complete) == 2 and not partial, "the resumed sweep discarded the half-written cell"
    assert scores(tmp_path).equals(scores(uninterrupted))


def test_a_killed_group_sweep_resumes_to_the_same_outputs(tmp_path, uninterrupted):
    """The shared-prefill launcher killed by SIGINT while its engine runs: no cell of the group looks
    complete; the rerun computes all of them, and every sample equals the one-engine-per-cell
    sweep's (near-tie rule). A group killed by SIGKILL, every process of it at once, is
    tests/engine/test_cluster_launcher.py's killed job (the same ``harness.run.group.run_group`` in
    a submitit job): its resubmitted job finds none of the group's three cells published and runs
    them all (CI time: this test killed the group by SIGKILL first, a sweep start more)."""
    from harness.analysis.regression import compare

    def engine_started(complete, partial):
        return any((p / ENGINE_LOG).exists() for p in partial)

    kill_when(sweep(tmp_path, launcher="shared_prefill"), tmp_path, engine_started, signal.SIGINT)
    assert cells(tmp_path)[0] == [], "SIGINT: a cell of the killed group was published"

    resumed = sweep(tmp_path, launcher="shared_prefill")
    output, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, output[-3000:]
    assert "group 1/1 finished" in output
    complete, partial = cells(tmp_path)
    assert len(complete) == 2 and not partial
    assert not compare(uninterrupted, tmp_path)

"""The cluster launcher end to end on submitit's own local executor (``hydra/launcher=slurm_local``:
the Slurm launcher's jobs as real processes here): one job per shared-prefill group, every cell
published, and a job killed mid-group (its engine running) submitted again, resuming the group."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.records.results import is_complete
from tests.support import ROOT

pytestmark = pytest.mark.engine


def job_logs(sweep: Path) -> dict[str, str]:
    """Each submitit job's id (its controller's pid, for the local executor) and its log so far."""
    return {path.parent.name: path.read_text(errors="replace") for path in sweep.glob(".submitit/*/*_log.out")}


def kill_job(job_id: str) -> None:
    """What a lost node does to a job: its processes die at once, nothing cleans up."""
    for child in psutil.Process(int(job_id)).children(recursive=True):
        child.send_signal(signal.SIGKILL)


def test_a_cluster_sweep_runs_a_job_per_group_and_resumes_a_killed_one(tmp_path):
    runs, sweep = tmp_path / "runs", tmp_path / "sweep"
    command = [sys.executable, "run.py", "-m", "hydra/launcher=slurm_local", "model=tiny", "policy=full,paged,knorm",
               "budget=256", "data.tasks=[single_doc_qa]", "+data.context_words=[600]", "data.limit=1,2",
               f"output_dir={runs}", f"hydra.sweep.dir={sweep}", "hydra.launcher.poll_s=0.5"]
    sweep_process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
    killed, deadline = None, time.monotonic() + 900
    while killed is None and sweep_process.poll() is None and time.monotonic() < deadline:
        for job_id, log in job_logs(sweep).items():
            if "[engine] starting vLLM for group 2/2" in log:
                time.sleep(2)  # the engine is loading or generating
                kill_job(job_id)
                killed = job_id
                break
        time.sleep(0.5)
    output, _ = sweep_process.communicate(timeout=900)
    assert killed is not None, output
    assert sweep_process.returncode == 0, output

    # Two groups (data.limit 1 and 2), three cells each, every cell published once.
    cells = [path for path in runs.glob("tiny/*/*") if path.is_dir()]
    assert len(cells) == 6 and all(is_complete(cell) for cell in cells), cells
    assert not list(runs.rglob("*.partial")), "a killed group leaves no half-published cell"
    # (This kill is also the suite's group killed by SIGKILL: tests/engine/test_interrupt.py kills the
    # shared-prefill launcher by SIGINT only, and the "3 cell(s)" of the second attempt's log below says
    # the killed job published none of its group's cells.)
    # One job per group, plus the killed group's second attempt: three jobs, one engine each.
    logs = job_logs(sweep)
    assert len(logs) == 3, output
    assert all(log.count("[engine] starting vLLM") == 1 for log in logs.values())
    assert f"job {killed} (group 2/2) ended without a result" in output
    assert "submitted as job" in output and "(attempt 2)" in output
    # Each engine ran its group's three cells together, prefilling each prompt once.
    assert all("3 cell(s) (full cache, paged budget=256, knorm budget=256)" in log for log in logs.values())

    # Rerunning the command finds every cell complete and submits nothing.
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "0 group(s) to run" in again.stdout and len(job_logs(sweep)) == 3

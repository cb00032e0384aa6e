"""Each job of ``hydra/launcher=local_parallel`` gets its own share of the machine (``harness.run.devices``)."""
from __future__ import annotations

import pytest

from harness.config import ConfigError
from harness.run.devices import job_share


def test_cpu_jobs_split_the_cores_between_them():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    shares = [job_share(job, 4, "cpu", cores, [], None).cores for job in range(6)]
    assert shares[:4] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert shares[4:] == shares[:2]
    with pytest.raises(ConfigError, match="n_jobs=3 engines at once of 1 rank"):
        job_share(0, 3, "cpu", [0, 1], [], None)
    with pytest.raises(ConfigError, match="n_jobs=2 engines at once of 2 rank.s. each need 4 cores; this machine gives 2"):
        job_share(0, 2, "cpu", [0, 1], [], None, tp_size=2)


def test_worker_processes_claim_distinct_slots_and_keep_them(tmp_path):
    """Each joblib worker holds one slot while it lives, whichever cells it is handed; a lock
    held elsewhere (here another open file description) is skipped."""
    import fcntl

    from harness.run.devices import claim_slot

    held = open(tmp_path / "slot-0.lock", "w")
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another worker holds slot 0
    assert claim_slot(tmp_path, 3) == 1
    assert claim_slot(tmp_path, 3) == 1, "a worker keeps its slot for its next cells"
    other = tmp_path / "other"
    other.mkdir()
    held_too = open(other / "slot-0.lock", "w")
    fcntl.flock(held_too, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(RuntimeError, match="all 1 local_parallel slots"):
        claim_slot(other, 1)


def test_gpu_jobs_take_a_device_each_and_share_one_only_with_its_memory():
    alone = [job_share(job, 2, "cuda", [], ["0", "1"], 0.9) for job in range(2)]
    assert [(s.gpus, s.gpu_memory_utilization) for s in alone] == [("0", 0.9), ("1", 0.9)]
    crowded = [job_share(job, 4, "cuda", [], ["0", "1"], None) for job in range(4)]
    assert [s.gpus for s in crowded] == ["0", "1", "0", "1"]
    assert all(s.gpu_memory_utilization == pytest.approx(0.45) for s in crowded)


def test_tensor_parallel_jobs_take_a_set_of_devices():
    shares = [job_share(job, 2, "cuda", [], ["0", "1", "2", "3"], 0.8, tp_size=2) for job in range(2)]
    assert [(s.gpus, s.gpu_memory_utilization) for s in shares] == [("0,1", 0.8), ("2,3", 0.8)]
    with pytest.raises(ConfigError, match="needs 4 GPU"):
        job_share(0, 1, "cuda", [], ["0", "1"], None, tp_size=4)

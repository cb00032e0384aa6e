"""Each job of ``hydra/launcher=local_parallel`` on its own share of the machine.

Hydra's joblib launcher runs ``n_jobs`` cells at once on one machine, each starting its own engine.
Left alone, every engine would take every core (CPU) or ask for 0.9 of the same GPU, and the
second would be refused (``vllm/v1/worker/utils.py:761-770``). Each of the launcher's worker
processes claims a slot k of n once (a lock file in the sweep directory, held while it lives:
joblib hands cells to whichever worker is free, so a cell's number says nothing of which slots are
taken) and every cell it runs takes:

* on CPU, the k-th of n equal slices of the cores the worker started with (its affinity; the
  engine then runs one thread per core it holds, split between its tensor-parallel ranks);
* on GPUs, the k-th (mod the number of sets) set of ``tensor_parallel_size`` visible devices,
  and when several jobs share a set, an equal share of the memory one job would take
  (``gpu_memory_utilization / jobs on it``).
"""
from __future__ import annotations

import fcntl
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from harness.config import ConfigError, RunSettings

DEFAULT_GPU_UTILIZATION = 0.9  # vLLM's default share of a device
# What a joblib worker could use before its first job narrowed it (workers run several jobs in turn).
CORES_VARIABLE, GPUS_VARIABLE = "KV_HARNESS_WORKER_CORES", "KV_HARNESS_WORKER_GPUS"


@dataclass(frozen=True)
class JobShare:
    cores: tuple[int, ...] | None = None     # CPU: the cores this job runs on
    gpus: str | None = None                   # GPU: the devices it sees (CUDA_VISIBLE_DEVICES)
    gpu_memory_utilization: float | None = None


def job_share(slot: int, jobs: int, device: str, cores: list[int], gpus: list[str],
              utilization: float | None, tp_size: int = 1) -> JobShare:
    """What the job in ``slot`` of ``jobs`` running at once may use (``tp_size``: its engine's
    tensor-parallel ranks, each needing a core or a GPU)."""
    if device == "cpu":
        per_job = len(cores) // jobs
        if per_job < tp_size:
            raise ConfigError(f"hydra.launcher.n_jobs={jobs} engines at once of {tp_size} rank(s) each need "
                              f"{jobs * tp_size} cores; this machine gives {len(cores)}: lower n_jobs")
        index = slot % jobs
        return JobShare(cores=tuple(cores[index * per_job : (index + 1) * per_job]))
    sets = len(gpus) // tp_size
    if not sets:
        raise ConfigError(f"hydra/launcher=local_parallel needs {tp_size} GPU(s) per job; {len(gpus)} visible")
    sharing = math.ceil(jobs / sets)  # the most jobs any set of devices runs
    index = slot % sets
    share = (utilization or DEFAULT_GPU_UTILIZATION) / sharing
    return JobShare(gpus=",".join(gpus[index * tp_size : (index + 1) * tp_size]),
                    gpu_memory_utilization=share if sharing > 1 else utilization)


def visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu for gpu in listed.split(",") if gpu.strip()]
    import torch  # counts devices through NVML, without creating a CUDA context here

    return [str(index) for index in range(torch.cuda.device_count())]


_claimed: dict[str, tuple[int, object]] = {}  # lock directory -> (slot, the open lock file)


def claim_slot(directory: Path, slots: int) -> int:
    """The first of ``slots`` slots no other live process holds, held by this process from now on
    (an exclusive ``flock`` on ``slot-<k>.lock``, released when the process ends)."""
    key = str(directory)
    if key in _claimed:
        return _claimed[key][0]
    directory.mkdir(parents=True, exist_ok=True)
    for slot in range(slots):
        handle = open(directory / f"slot-{slot}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        _claimed[key] = (slot, handle)
        return slot
    raise RuntimeError(f"all {slots} local_parallel slots under {directory} are held by other processes")


def local_parallel_job() -> tuple[int, int] | None:
    """(this worker's slot, jobs at once) when Hydra's joblib launcher runs this cell, else None."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    launcher = hydra.launcher
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return None
    jobs = int(launcher.get("n_jobs") or 1)
    if jobs <= 1:
        return None
    return claim_slot(Path(hydra.sweep.dir) / ".local_parallel", jobs), jobs


def take_job_share(run: RunSettings) -> RunSettings:
    """Under ``local_parallel``, restrict this process to its job's share and return the settings
    its engine must use; otherwise ``run`` unchanged. The cell's name does not change."""
    placement = local_parallel_job()
    if placement is None:
        return run
    job, jobs = placement
    if run.engine.device == "cpu":
        # A joblib worker may run several jobs in turn: share out the cores it started with.
        os.environ.setdefault(CORES_VARIABLE, ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        cores = [int(core) for core in os.environ[CORES_VARIABLE].split(",")]
        share = job_share(job, jobs, "cpu", cores, [], None, run.engine.tensor_parallel_size)
        os.sched_setaffinity(0, share.cores)
        print(f"[local_parallel] slot {job} of {jobs} at once: cores {list(share.cores)}", flush=True)
        return run
    os.environ.setdefault(GPUS_VARIABLE, ",".join(visible_gpus()))
    gpus = [gpu for gpu in os.environ[GPUS_VARIABLE].split(",") if gpu]
    share = job_share(job, jobs, run.engine.device, [], gpus, run.engine.gpu_memory_utilization,
                      run.engine.tensor_parallel_size)
    os.environ["CUDA_VISIBLE_DEVICES"] = share.gpus
    print(f"[local_parallel] slot {job} of {jobs} at once: GPU(s) {share.gpus}, gpu_memory_utilization "
          f"{share.gpu_memory_utilization}", flush=True)
    return replace(run, engine=replace(run.engine, gpu_memory_utilization=share.gpu_memory_utilization))

"""Each job of ``hydra/launcher=local_parallel`` on its own share of the machine.

Hydra's joblib launcher runs ``n_jobs`` cells at once on one machine, each starting its own engine.
Left alone, every engine would take every core (CPU) or ask for 0.9 of the same GPU, and the
second would be refused (``vllm/v1/worker/utils.py:761-770``). So job ``k`` of ``n`` takes:

* on CPU, the k-th of n equal slices of the cores this process may use (its affinity; the engine
  then runs one thread per core it holds);
* on GPUs, the k-th (mod the number of sets) set of ``tensor_parallel_size`` visible devices,
  and when several jobs share a set, an equal share of the memory one job would take
  (``gpu_memory_utilization / jobs on it``).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from harness.config import ConfigError, RunSettings

DEFAULT_GPU_UTILIZATION = 0.9  # vLLM's default share of a device
# What a joblib worker could use before its first job narrowed it (workers run several jobs in turn).
CORES_VARIABLE, GPUS_VARIABLE = "KV_HARNESS_WORKER_CORES", "KV_HARNESS_WORKER_GPUS"


@dataclass(frozen=True)
class JobShare:
    cores: tuple[int, ...] | None = None     # CPU: the cores this job runs on
    gpus: str | None = None                   # GPU: the devices it sees (CUDA_VISIBLE_DEVICES)
    gpu_memory_utilization: float | None = None


def job_share(job: int, jobs: int, device: str, cores: list[int], gpus: list[str],
              utilization: float | None, per_job: int = 1) -> JobShare:
    """What job ``job`` of ``jobs`` running at once may use."""
    if device == "cpu":
        if jobs > len(cores):
            raise ConfigError(f"hydra.launcher.n_jobs={jobs} engines at once need a core each; this machine "
                              f"gives {len(cores)}: lower n_jobs")
        per_job = len(cores) // jobs
        index = job % jobs
        return JobShare(cores=tuple(cores[index * per_job : (index + 1) * per_job]))
    sets = len(gpus) // per_job  # per_job: the engine's tensor_parallel_size
    if not sets:
        raise ConfigError(f"hydra/launcher=local_parallel needs {per_job} GPU(s) per job; {len(gpus)} visible")
    sharing = math.ceil(jobs / sets)  # the most jobs any set of devices runs
    index = job % sets
    share = (utilization or DEFAULT_GPU_UTILIZATION) / sharing
    return JobShare(gpus=",".join(gpus[index * per_job : (index + 1) * per_job]),
                    gpu_memory_utilization=share if sharing > 1 else utilization)


def visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu for gpu in listed.split(",") if gpu.strip()]
    import torch  # counts devices through NVML, without creating a CUDA context here

    return [str(index) for index in range(torch.cuda.device_count())]


def local_parallel_job() -> tuple[int, int] | None:
    """(this job's number, jobs at once) when Hydra's joblib launcher runs this cell, else None."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    launcher = hydra.launcher
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return None
    jobs = int(launcher.get("n_jobs") or 1)
    return (int(hydra.job.num), jobs) if jobs > 1 else None


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
        share = job_share(job, jobs, "cpu", cores, [], None)
        os.sched_setaffinity(0, share.cores)
        print(f"[local_parallel] job {job} of {jobs} at once: cores {list(share.cores)}", flush=True)
        return run
    os.environ.setdefault(GPUS_VARIABLE, ",".join(visible_gpus()))
    gpus = [gpu for gpu in os.environ[GPUS_VARIABLE].split(",") if gpu]
    share = job_share(job, jobs, run.engine.device, [], gpus, run.engine.gpu_memory_utilization,
                      run.engine.tensor_parallel_size)
    os.environ["CUDA_VISIBLE_DEVICES"] = share.gpus
    print(f"[local_parallel] job {job} of {jobs} at once: GPU(s) {share.gpus}, gpu_memory_utilization "
          f"{share.gpu_memory_utilization}", flush=True)
    return replace(run, engine=replace(run.engine, gpu_memory_utilization=share.gpu_memory_utilization))

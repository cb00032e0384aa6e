"""A sweep on a cluster: one submitit job per shared-prefill group, not per cell.

The cells of a group share one engine and prefill each prompt once (``harness.run.group``); a job per
cell would start an engine per cell and prefill every prompt once per cell. So a cluster sweep
submits each group whose cells are not all complete as one job (``GroupJob``) and waits for them,
at most ``parallelism`` in flight. Each job publishes its cells atomically as a local sweep does,
so a job that dies (a killed process, a lost node) leaves no half-written cell: it is submitted
again, up to ``retries`` times, and its cells already complete are skipped. On Slurm, a job that
reaches its time limit or is preempted checkpoints by requeueing itself (submitit's
``Checkpointable``): the requeued job skips what is complete. A group's cells are published
together when its generation ends, so ``timeout_min`` must cover a whole group (a group that
outlasts it restarts from its start on every requeue). A job that fails with an error (a config
vLLM refuses, a bug) is not retried: its error is printed. With ``force=true`` a resubmitted job
recomputes its group's cells again, as a local forced sweep would.

``cluster="local"`` runs the same jobs as processes on this machine through submitit's own local
executor, which is how the launcher is tested; ``cluster="slurm"`` submits them with sbatch.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from harness.config import ConfigError, RunSettings
from harness.records.results import is_complete


class GroupJob(submitit.helpers.Checkpointable):
    """One group's cells on one engine, in the submitting directory (relative output paths)."""

    def __init__(self, runs: list[RunSettings], name: str, cwd: str):
        self.runs, self.name, self.cwd = runs, name, cwd

    def __call__(self) -> dict[str, str]:
        from harness.run.group import run_group

        os.chdir(self.cwd)
        return run_group(self.runs, self.name)


@dataclass
class Submission:
    """A group's job, and how many times it has been submitted."""

    group: int
    job: object
    attempts: int = 1


@dataclass
class ClusterSettings:
    cluster: str = "slurm"          # "slurm", or "local": processes on this machine (submitit's local executor)
    folder: str = ".submitit/%j"    # submitit's job files and logs (%j: the job id)
    parallelism: int = 16           # group jobs in flight at once
    retries: int = 1                # resubmissions of a job that died without a result
    poll_s: float = 5.0
    parameters: dict = field(default_factory=dict)  # submitit's: timeout_min, gpus_per_node, slurm_partition, ...


def executor_for(settings: ClusterSettings) -> submitit.Executor:
    if settings.cluster not in ("slurm", "local"):
        raise ConfigError(f"cluster={settings.cluster!r}; valid: slurm, local")
    if settings.parallelism < 1 or settings.retries < 0:
        raise ConfigError(f"parallelism must be at least 1 and retries at least 0, got {settings.parallelism}, "
                         f"{settings.retries}")
    executor = submitit.AutoExecutor(folder=settings.folder, cluster=settings.cluster)
    executor.update_parameters(**settings.parameters)
    return executor


def run_on_cluster(runs: list[RunSettings], settings: ClusterSettings, say=print) -> list[str]:
    """Run every cell, one job per group; returns "done", "skipped" or "failed" per cell, in order."""
    from harness.run.group import groups_of

    executor = executor_for(settings)
    groups = groups_of(runs)
    todo = [number for number, (_, distinct) in enumerate(groups)
            if any(runs[i].force or not is_complete(runs[i].run_dir) for i in distinct)]
    say(f"[cluster] {len(runs)} cells in {len(groups)} groups; {len(todo)} group(s) to run as "
        f"{settings.cluster} jobs, at most {settings.parallelism} at once (logs: {settings.folder})")
    outcome = ["skipped"] * len(runs)
    waiting, running = list(todo), []
    cwd = os.getcwd()

    def submit(number: int, attempts: int = 1) -> None:
        cells = [runs[i] for i in groups[number][1]]
        name = f"group {number + 1}/{len(groups)}"
        executor.update_parameters(name=f"kv-eviction-{number + 1}")
        job = executor.submit(GroupJob(cells, name, cwd))
        running.append(Submission(number, job, attempts))
        say(f"[cluster] {name} ({', '.join(run.label for run in cells)}) submitted as job {job.job_id}"
            + (f" (attempt {attempts})" if attempts > 1 else ""))

    while waiting or running:
        while waiting and len(running) < settings.parallelism:
            submit(waiting.pop(0))
        time.sleep(settings.poll_s if running and not any(s.job.done() for s in running) else 0)
        for submission in [s for s in running if s.job.done()]:
            running.remove(submission)
            members, _ = groups[submission.group]
            name = f"group {submission.group + 1}/{len(groups)}"
            try:
                done = submission.job.result()
            except FailedJobError as error:  # the job's own exception (a subclass of the next)
                say(f"[cluster] job {submission.job.job_id} ({name}) failed: {str(error).strip().splitlines()[-1]} "
                    f"(log: {submission.job.paths.stderr})")
                done = None
            except UncompletedJobError as error:
                if submission.attempts <= settings.retries:
                    say(f"[cluster] job {submission.job.job_id} ({name}) ended without a result "
                        f"({str(error).splitlines()[0]}): submitting it again, its complete cells are skipped")
                    submit(submission.group, submission.attempts + 1)
                    continue
                say(f"[cluster] job {submission.job.job_id} ({name}) ended without a result after "
                    f"{submission.attempts} attempt(s); rerun the sweep to resume it")
                done = None
            for index in members:
                outcome[index] = "failed" if done is None else done.get(str(runs[index].run_dir), "skipped")
            if done is not None:
                say(f"[cluster] job {submission.job.job_id} ({name}) finished: {sum(v == 'done' for v in done.values())} "
                    f"cell(s) published")
    return outcome

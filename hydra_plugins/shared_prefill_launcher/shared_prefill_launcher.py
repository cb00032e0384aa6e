"""Hydra launchers for ``run.py -m``: the cells of a sweep that share model, data and engine
settings run on one engine, each prompt prefilled once (``harness.run.group``).

* ``SharedPrefillLauncher`` (``hydra/launcher=shared_prefill``, the default): the groups one after
  the other in this process.
* ``ClusterGroupLauncher`` (``hydra/launcher=slurm_gpu``, ``slurm_local``): one submitit job per
  group, on Slurm or as local processes (``harness.run.cluster``).

Hydra hands a launcher every job of the sweep at once (``Launcher.launch``), which is what
grouping needs. Hydra only instantiates launchers from the ``hydra_plugins`` package, hence this
module's place. ``hydra/launcher=basic`` runs one engine per cell instead.
"""
import sys
from typing import Sequence

from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict


# Configured by conf/hydra/launcher/*.yaml (Hydra scans this module without registering it in
# sys.modules, so it defines no dataclass).


class GroupLauncher(Launcher):
    """Checks every cell, runs them by groups (``run``), and reports each cell's outcome to Hydra."""

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config

    def run(self, runs: list) -> list[str]:
        raise NotImplementedError

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from harness.config import ConfigError, run_settings
        from harness.eviction.messages import EvictionNotActiveError

        setup_globals()
        cells = []
        for overrides in job_overrides:
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                del sweep_config["hydra"]
            cells.append(sweep_config)
        try:
            outcomes = self.run([run_settings(cell) for cell in cells])
        except (ConfigError, EvictionNotActiveError) as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        returns = []
        for overrides, cfg, outcome in zip(job_overrides, cells, outcomes):
            job = JobReturn(overrides=list(overrides), cfg=cfg,
                            status=JobStatus.FAILED if outcome == "failed" else JobStatus.COMPLETED)
            job.return_value = outcome
            returns.append(job)
        if "failed" in outcomes:
            print(f"error: {outcomes.count('failed')} of {len(outcomes)} cells did not finish; rerun the same "
                  "command to resume them (complete cells are skipped)", file=sys.stderr)
            sys.exit(1)
        return returns


class SharedPrefillLauncher(GroupLauncher):
    def run(self, runs: list) -> list[str]:
        from harness.run.group import run_grouped

        return run_grouped(runs)


class ClusterGroupLauncher(GroupLauncher):
    def __init__(self, **settings) -> None:
        self.settings = settings

    def run(self, runs: list) -> list[str]:
        from harness.run.cluster import ClusterSettings, run_on_cluster

        settings = dict(self.settings)
        parameters = settings.pop("parameters", None) or {}
        if isinstance(parameters, DictConfig):
            parameters = OmegaConf.to_container(parameters, resolve=True)
        return run_on_cluster(runs, ClusterSettings(**settings, parameters=dict(parameters)))

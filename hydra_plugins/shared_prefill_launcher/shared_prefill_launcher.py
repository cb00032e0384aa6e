"""Hydra launcher for ``run.py -m``: the cells of a sweep that share model, data and engine
settings run on one engine, each prompt prefilled once (``harness.group``).

Hydra hands a launcher every job of the sweep at once (``Launcher.launch``), which is what
grouping needs. Hydra only instantiates launchers from the ``hydra_plugins`` package, hence this
module's place. ``hydra/launcher=basic`` runs one engine per cell instead.
"""
import sys
from typing import Sequence

from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict


# Configured by conf/hydra/launcher/shared_prefill.yaml (Hydra scans this module without
# registering it in sys.modules, so it defines no dataclass).


class SharedPrefillLauncher(Launcher):
    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from harness.config import ConfigError, run_settings
        from harness.eviction.messages import EvictionNotActiveError
        from harness.group import run_grouped

        setup_globals()
        cells = []
        for overrides in job_overrides:
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                del sweep_config["hydra"]
            cells.append(sweep_config)
        try:
            outcomes = run_grouped([run_settings(cell) for cell in cells])
        except (ConfigError, EvictionNotActiveError) as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        returns = []
        for overrides, cfg, outcome in zip(job_overrides, cells, outcomes):
            job = JobReturn(overrides=list(overrides), cfg=cfg, status=JobStatus.COMPLETED)
            job.return_value = outcome
            returns.append(job)
        return returns

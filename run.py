"""Run one cell, or a sweep with -m:  python run.py policy=paged budget=1024

Configuration lives in conf/ (Hydra); see docs/configuration.md for the common command lines.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from harness.records import interrupts
from harness.config import ConfigError, run_settings
from harness.run.devices import take_job_share
from harness.eviction.messages import EvictionNotActiveError
from harness.run.group import run_cell


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> str:
    try:
        status, _ = run_cell(take_job_share(run_settings(cfg)))
        return status
    except (ConfigError, EvictionNotActiveError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    interrupts.install()
    main()

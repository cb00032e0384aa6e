"""Hydra callback for sweeps (``python run.py -m ...``): check every cell first, then show progress.

Before the first cell runs, every cell's config is composed and validated, so a bad budget in
the fifth cell stops the sweep before any engine starts. Each finished cell prints how many are
done, how many were already complete (skipped, e.g. full cache once per model and data, or an
interrupted sweep resuming) and an estimate of the time left. When the sweep ends, its cells are
compared: the score table with intervals and the paired differences (``harness.analysis.aggregate``).
"""
from __future__ import annotations

import sys
import time
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every cell's overrides, as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    (cells,) = BasicSweeper.split_arguments(parsed, None)
    return cells


def sweep_cells(config: DictConfig, overrides: list[str]) -> list[list[str]]:
    """Every cell's overrides of ``run.py -m <overrides>``: the sweep parameters of ``config``
    (composed with Hydra's config; an experiment's ``hydra.sweeper.params``) and then the command
    line's, which replace them where both name a key, expanded as the sweep expands them."""
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    return expand_sweep(params + list(overrides))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class SweepProgress(Callback):
    def __init__(self) -> None:
        self.total = self.done = self.skipped = 0
        self.work_seconds = 0.0
        self.started = self.job_started = 0.0
        self.cells: set[str] = set()
        self.pending: set[str] = set()  # distinct run directories still to compute: what time is left for

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose

        from harness.config import ConfigError, run_settings
        from harness.records.results import is_complete

        cells = sweep_cells(config, list(config.hydra.overrides.task))
        pending = self.pending
        for overrides in cells:
            cell = compose(config_name="config", overrides=overrides)
            try:
                run = run_settings(cell)
            except ConfigError as error:
                print(f"error: cell {' '.join(overrides)}: {error}", file=sys.stderr)
                sys.exit(2)
            target = str(run.run_dir)
            if not is_complete(run.run_dir):
                pending.add(target)
            self.cells.add(target)
        self.total = len(cells)
        self.started = time.perf_counter()
        print(f"[sweep] {self.total} cells ({len(self.cells)} distinct runs, {len(pending)} to compute)", flush=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.job_started = time.perf_counter()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from harness.config import run_settings

        if not self.total:
            return  # a single run (Hydra calls job callbacks without a multirun): nothing to count
        self.done += 1
        self.pending.discard(str(run_settings(config, checked=False).run_dir))
        elapsed = time.perf_counter() - self.job_started
        outcome = getattr(job_return, "_return_value", None)
        if outcome == "skipped":
            self.skipped += 1
        else:
            self.work_seconds += elapsed
        computed = self.done - self.skipped
        remaining = len(self.pending)  # a cell repeating a finished run (full cache per budget) costs nothing
        eta = f"~{_duration(self.work_seconds / computed * remaining)} left" if computed and remaining else ""
        print(
            f"[sweep] {self.done}/{self.total} cells done ({self.skipped} already complete) | "
            f"elapsed {_duration(time.perf_counter() - self.started)} {eta}",
            flush=True,
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from pathlib import Path

        from harness.records.results import is_complete

        complete = [Path(cell) for cell in sorted(self.cells) if is_complete(Path(cell))]
        if len(complete) < 2:
            return  # nothing to compare
        from harness.analysis.aggregate import load_runs, to_markdown

        command = "python -m harness.analysis.aggregate " + " ".join(str(cell) for cell in complete)
        print(to_markdown(load_runs(complete), command), flush=True)

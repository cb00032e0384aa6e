"""The command that adds a newly registered policy's cells to the committed CI baseline (what
tests/engine/test_regression.py prints when a policy has none, ``add_cells_command``): Hydra's basic
sweeper lets its ``policy=`` replace the experiment's ``${kv_policies:}``, so it sweeps exactly the
named policies' cells, each named as the whole ``ci_regression`` sweep names it: it adds them beside
the committed cells and reruns none of those."""
from __future__ import annotations

import shlex

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from harness.config import run_settings
from harness.run.sweep import expand_sweep
from tests.support import ROOT
from tests.support.ci_baseline import add_cells_command, baseline_cells, cell_policy


def swept_run_dirs(overrides: list[str]) -> list:
    """The run directory of every cell ``run.py -m <overrides>`` runs: the config's
    ``hydra.sweeper.params`` and then the command line's overrides, expanded as the basic sweeper
    does (``harness.run.sweep.expand_sweep``; a later override of a key replaces an earlier one)."""
    fixed = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = compose("config", overrides=fixed, return_hydra_config=True)  # a sweep composes per cell
        params = [f"{key}={value}" for key, value in config.hydra.sweeper.params.items()]
        task = [o for o in overrides if not o.startswith(("hydra/", "hydra."))]
        return [run_settings(compose("config", overrides=cell)).run_dir for cell in expand_sweep(params + task)]


def test_the_add_cells_command_sweeps_exactly_the_named_policies_cells_as_committed():
    command = shlex.split(add_cells_command(["full", "value_norm"]))
    assert command[:3] == [".venv/bin/python", "run.py", "-m"] and "hydra/launcher=basic" in command
    run_dirs = swept_run_dirs(command[3:])
    assert len(run_dirs) == 4, "full cache and value_norm, each at budgets 256 and 512"
    committed = {cell.relative_to(ROOT) for cell in baseline_cells() if cell_policy(cell) in ("full", "value_norm")}
    assert len(committed) == 3 and set(run_dirs) == committed, "full cache once, value_norm at two budgets"

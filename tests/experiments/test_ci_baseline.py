"""The command that adds a newly registered policy's cells to the committed CI baseline (what
tests/engine/test_regression.py prints when a policy has none, ``add_cells_command``): Hydra's basic
sweeper lets its ``policy=`` replace the experiment's ``${kv_policies:}``, so it sweeps exactly the
named policies' cells, each named as the whole ``ci_regression`` sweep names it: it adds them beside
the committed cells and reruns none of those. And the comparison of a rerun on each task's first
samples with the baseline (``compare_first_samples``), on the committed cells themselves."""
from __future__ import annotations

import json
import shlex

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from harness.config import run_settings
from harness.run.sweep import sweep_cells
from tests.support import ROOT
from tests.support.ci_baseline import CI_BASELINE, add_cells_command, baseline_cells, cell_policy


def swept_run_dirs(overrides: list[str]) -> list:
    """The run directory of every cell ``run.py -m <overrides>`` runs: the config's
    ``hydra.sweeper.params`` and then the command line's overrides, expanded as the basic sweeper
    does (``harness.run.sweep.sweep_cells``; a later override of a key replaces an earlier one)."""
    fixed = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = compose("config", overrides=fixed, return_hydra_config=True)  # a sweep composes per cell
        task = [o for o in overrides if not o.startswith(("hydra/", "hydra."))]
        return [run_settings(compose("config", overrides=cell)).run_dir for cell in sweep_cells(config, task)]


def test_the_add_cells_command_sweeps_exactly_the_named_policies_cells_as_committed():
    command = shlex.split(add_cells_command(["full", "value_norm"]))
    assert command[:3] == [".venv/bin/python", "run.py", "-m"] and "hydra/launcher=basic" in command
    run_dirs = swept_run_dirs(command[3:])
    assert len(run_dirs) == 4, "full cache and value_norm, each at budgets 256 and 512"
    committed = {cell.relative_to(ROOT) for cell in baseline_cells() if cell_policy(cell) in ("full", "value_norm")}
    assert len(committed) == 3 and set(run_dirs) == committed, "full cache once, value_norm at two budgets"


def first_samples_copy(root, per_task: int, digest: str = "00000000") -> None:
    """The committed baseline's cells as a rerun on ``per_task`` samples per task would write them:
    each cell under its name with another digest, holding each task's first ``per_task`` rows."""
    from harness.records.results import read_jsonl
    from tests.support.ci_baseline import cell_stem

    for cell in baseline_cells():
        rows = read_jsonl(cell / "predictions.jsonl")
        kept = [row for task in dict.fromkeys(row["task"] for row in rows)
                for row in [r for r in rows if r["task"] == task][:per_task]]
        target = root / cell.parent.relative_to(CI_BASELINE) / f"{cell_stem(cell.name)}_{digest}"
        target.mkdir(parents=True)
        (target / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))


def test_the_first_samples_comparison_pairs_cells_by_stem_and_names_every_moved_sample(tmp_path):
    """``compare_first_samples`` (what tests/engine/test_regression.py applies to its rerun on each
    task's first samples): the baseline's own first four rows per task compare equal; compared as
    five per task, every cell's samples differ; a moved output token and a missing cell are each
    named."""
    from harness.records.results import read_jsonl
    from tests.support.ci_baseline import compare_first_samples

    first_samples_copy(tmp_path, 4)
    assert compare_first_samples(tmp_path, 4) == []
    assert all("samples differ" in problem for problem in compare_first_samples(tmp_path, 5))

    (paged,) = tmp_path.glob("*/*/paged_b256_bs32_00000000")
    rows = read_jsonl(paged / "predictions.jsonl")
    rows[1]["output_token_ids"] = [-1, *rows[1]["output_token_ids"][1:]]  # no token the baseline's top-3 holds
    (paged / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (full,) = tmp_path.glob("*/*/full_bs32_00000000")
    (full / "predictions.jsonl").unlink()
    problems = compare_first_samples(tmp_path, 4)
    assert len(problems) == 2, problems
    assert problems[0] == f"smollm2-135m/synthetic/full_bs32: missing from {tmp_path}"
    assert problems[1].startswith(f"smollm2-135m/synthetic/paged_b256_bs32 {rows[1]['id']}: diverges at output token 0")

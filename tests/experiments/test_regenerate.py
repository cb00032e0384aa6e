"""The regeneration plan names steps that exist and runs nothing in --plan mode."""
from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "experiments"))

import regenerate  # noqa: E402
import throughput  # noqa: E402


def test_every_step_runs_something_that_exists():
    names = [step.name for step in regenerate.STEPS]
    assert len(names) == len(set(names))
    for step in regenerate.STEPS:
        for command in step.commands:
            if "run.py" in command:
                experiment = next(a for a in command if a.startswith("+experiment=")).split("=", 1)[1]
                assert (ROOT / "conf" / "experiment" / f"{experiment}.yaml").exists(), step.name
            if "experiments/throughput.py" in command:
                assert command[command.index("experiments/throughput.py") + 1] in throughput.SETTINGS | throughput.PREFILL_SETTINGS, step.name


def test_a_study_on_a_second_model_ends_beside_the_one_it_repeats():
    """The Gemma studies repeat SmolLM2's cells: their step's last command sets the two side by side
    (harness.analysis.cross_model) in a folder under the study's own, where the plan keeps it."""
    steps = {step.name: step for step in regenerate.STEPS}
    for name, repeats in (("cpu_accuracy_gemma3", "cpu_accuracy"), ("ruler_context_gemma3", "ruler_context")):
        *_, last = steps[name].commands
        assert last[1:] == ("-m", "harness.analysis.cross_model", f"results/{repeats}", f"results/{name}",
                            "--out", f"results/{name}/across_models")
        assert repeats in steps
    assert not any("cross_model" in " ".join(command) for step in regenerate.STEPS if "gemma3" not in step.name
                   for command in step.commands)


def test_trials_interleave_every_configuration():
    setting = throughput.with_trials(throughput.SETTINGS["attention"], 3)
    first = [cell for cell in setting.cells if cell.trial == 1]
    assert [cell.trial for cell in setting.cells] == [t for t in (1, 2, 3) for _ in first]
    assert {cell.policy for cell in first} >= {"full", "paged", "snapkv", "h2o", "lru"}  # the once-only cells too
    assert setting.baseline.trial == 1


def test_plan_prints_every_step_and_runs_nothing():
    before = {p: p.stat().st_mtime for p in (ROOT / "results").glob("*/summary.csv")}
    out = subprocess.run([sys.executable, "experiments/regenerate.py", "--plan"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    for step in regenerate.STEPS:
        assert step.name in out
    assert "code version" in out
    assert {p: p.stat().st_mtime for p in (ROOT / "results").glob("*/summary.csv")} == before


def test_unknown_step_is_refused_with_the_valid_ones():
    done = subprocess.run([sys.executable, "experiments/regenerate.py", "--only", "nope"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "unknown step(s) nope" in done.stderr and "cpu_accuracy" in done.stderr


def test_the_ruler_experiment_says_how_its_committed_results_ran():
    """conf/experiment/ruler_ratios.yaml's comments give the command of the regeneration's RULER
    step, every override in it (its own defaults make a smaller run, not the committed one)."""
    (step,) = [step for step in regenerate.STEPS if step.name == "ruler"]
    run = next(command for command in step.commands if "run.py" in command)
    overrides = run[run.index("+experiment=ruler_ratios") + 1:]
    comments = "\n".join(line for line in (ROOT / "conf/experiment/ruler_ratios.yaml").read_text().splitlines()
                         if line.startswith("#"))
    assert overrides and all(override in comments for override in overrides), overrides
    assert "As committed (results/ruler_pilot)" not in comments


def test_every_committed_serving_sweep_is_a_step_remade_by_the_command_that_made_it():
    """results/serving/<sweep>: a step whose command is the one its settings.json recorded (the
    regeneration remakes what is committed, not the default sweep), its provenance that file."""
    import json
    import shlex

    sweeps = sorted(path.parent for path in (ROOT / "results" / "serving").glob("*/settings.json"))
    steps = {step.folder: step for step in regenerate.STEPS if step.serving}
    assert sweeps and sorted(steps) == [f"serving/{sweep.name}" for sweep in sweeps]
    for sweep in sweeps:
        step = steps[f"serving/{sweep.name}"]
        (command,) = step.commands
        recorded = json.loads((sweep / "settings.json").read_text())["command"]
        assert [*command[1:]] == shlex.split(recorded)[1:], (command, recorded)
        assert step.cells() == [sweep / "settings.json"]
        assert regenerate.version_of(sweep / "settings.json") is not None


def test_a_study_missing_cells_of_its_sweep_is_partial_whatever_its_summary_says(tmp_path, monkeypatch):
    """A study made in chunks (policy by policy, over sessions) holds some of its sweep's cells at
    this version and a summary newer than them: it reads ``partial`` until every cell its sweep
    writes exists, then ``done``; the plan says how many are missing."""
    import yaml

    (step,) = [step for step in regenerate.STEPS if step.name == "ruler_context_gemma3"]
    wanted = sorted(regenerate.sweep_run_dirs(tuple(step.commands[0][step.commands[0].index("-m") + 1:])))
    assert len(wanted) == 33  # full cache once, eight policies at four ratios
    monkeypatch.setattr(regenerate, "ROOT", tmp_path)

    def make(cell: str) -> None:
        folder = tmp_path / cell
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"provenance": {"code_version": "v1"}}))
        (folder / "perf.json").write_text("{}")

    for cell in wanted[:-1]:
        make(cell)
    (tmp_path / "results" / step.folder / "summary.csv").write_text("x\n")
    assert regenerate.held_status(step, "v1")[0] == "done"  # what the folder alone would say
    assert regenerate.status(step, "v1") == ("partial", [])
    assert regenerate.missing_cells(step) == [wanted[-1]]
    make(wanted[-1])
    (tmp_path / "results" / step.folder / "summary.csv").write_text("x\n")
    assert regenerate.status(step, "v1") == ("done", [])

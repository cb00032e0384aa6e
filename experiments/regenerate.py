"""Regenerate every committed accuracy and throughput result at one code version, over as many
sessions as it takes.

    python experiments/regenerate.py --plan          # each step: done at this version, partial, or to run
    python experiments/regenerate.py                 # run what is not done yet, in order; resumable
    python experiments/regenerate.py --only cpu_accuracy,throughput/cpu

A regeneration is only worth its hours if every table comes from the same code: it refuses to
start on a checkout whose code (``harness.records.provenance.code_version``: run.py, setup.sh, policies,
harness, hydra_plugins, conf, experiments) has uncommitted changes. Results already made at this
code version are kept, so a run interrupted at a session's end resumes where it stopped, and
commits that change only documents or results in between do not invalidate them; results made at
another code version are deleted before their step reruns (they are in git history). Each step
ends by rewriting its folder's summary; the last rewrites ``results/RESULTS.md``
(``python -m harness.analysis.report``).

The steps and their sample counts are the plan of record (``STEPS``); ``minutes`` is what a step
took on the 2-core CPU machine, or the estimate it is planned with where it has not run yet.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.records.provenance import code_version  # noqa: E402

PYTHON = sys.executable


@dataclass(frozen=True)
class Step:
    name: str
    folder: str  # under results/
    commands: tuple[tuple[str, ...], ...]
    minutes: float  # on the 2-core CPU machine (measured or planned, see ``measured``)
    measured: bool = False

    def cells(self) -> list[Path]:
        """The files or run directories that carry this step's provenance."""
        root = ROOT / "results" / self.folder
        if self.folder.startswith("throughput/"):
            return sorted((root / "cells").glob("*.json"))
        return sorted(path.parent for path in root.glob("**/config.yaml") if path.parent.name != ".hydra"
                      and (path.parent / "perf.json").exists())


def accuracy(name: str, experiment: str, minutes: float, *overrides: str, measured: bool = False) -> Step:
    folder = f"results/{name}"
    return Step(name, name, (
        (PYTHON, "run.py", "-m", f"+experiment={experiment}", f"output_dir={folder}", *overrides),
        (PYTHON, "-m", "harness.analysis.aggregate", folder, "--out", folder),
    ), minutes, measured)


def throughput(setting: str, minutes: float, trials: int = 3) -> Step:
    return Step(f"throughput/{setting}", f"throughput/{setting}",
                ((PYTHON, "experiments/throughput.py", setting, "--trials", str(trials)),), minutes)


# Sample counts: the embedded suite and the ablation at 20 per task, as committed (the
# sample-size plans in results/*/sample_size.md say what deciding every headline comparison would
# take: more than these sessions hold); RULER at kvpress's four compression ratios, 12 samples per
# task (6 per length), prompt-only compression. Throughput: three interleaved trials of every
# configuration. `quick` is a subset of `cpu`, `cpu_tight` repeats `cpu` on a smaller pool: not
# committed (they stay runnable); results/ruler replaces the RULER pilot. The proxy study and the
# eviction-cost benchmark are analyses of the method, not of its accuracy or throughput in the
# engine, and record no provenance yet: outside the plan.
STEPS = (
    accuracy("cpu_accuracy", "cpu_accuracy", 65),
    accuracy("ablation", "ablation", 40),
    accuracy("ruler", "ruler_ratios", 120, "data.limit=6", "budget_ratio=0.25,0.5,0.75,0.875"),
    throughput("cpu", 75),
    throughput("attention", 25),
    throughput("overhead", 13),
    throughput("latency", 10),
    throughput("shared_prefix", 10),
    throughput("tensor_parallel", 30),
)


def version_of(path: Path) -> str | None:
    if path.suffix == ".json":
        return (json.loads(path.read_text()).get("provenance") or {}).get("code_version")
    config = yaml.safe_load((path / "config.yaml").read_text())
    return (config.get("provenance") or {}).get("code_version")


def status(step: Step, version: str) -> tuple[str, list[Path]]:
    """``done`` (cells exist, all at this version and its summary newer than them), ``partial``
    (some at this version), ``to run``; and the cells made at another version."""
    cells = step.cells()
    stale = [cell for cell in cells if version_of(cell) != version]
    current = len(cells) - len(stale)
    summary = ROOT / "results" / step.folder / "summary.csv"
    if cells and not stale and summary.exists() and summary.stat().st_mtime >= max(c.stat().st_mtime for c in cells):
        return "done", stale
    return ("partial" if current else "to run"), stale


def retired(steps: list[Step]) -> list[str]:
    """Result folders with a summary that no step of the full plan writes."""
    planned = {step.folder for step in STEPS}
    found = [path.parent.relative_to(ROOT / "results").as_posix()
             for path in sorted((ROOT / "results").glob("**/summary.csv"))]
    return [f"results/{folder}" for folder in found
            if folder not in planned and not folder.startswith(("proxy_quality", "eviction_cost"))]


def run(command: tuple[str, ...]) -> None:
    print("$ " + " ".join(command[1:] if command[0] == PYTHON else command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print each step's state and time, run nothing")
    parser.add_argument("--only", help="comma-separated step names (default: every step)")
    args = parser.parse_args(argv)
    names = [step.name for step in STEPS]
    wanted = args.only.split(",") if args.only else names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        parser.error(f"--only: unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}")
    version = code_version(ROOT)
    if version is None:
        parser.error("not a git checkout: a regeneration records the code version it ran at")
    steps = [step for step in STEPS if step.name in wanted]
    states = {step.name: status(step, version) for step in steps}
    left = sum(step.minutes for step in steps if states[step.name][0] != "done")
    print(f"code version {version}; {len(steps)} steps, about {left / 60:.1f} h left on the 2-core CPU machine")
    for step in steps:
        state, stale = states[step.name]
        note = f", {len(stale)} made at another version (deleted before it runs)" if stale else ""
        print(f"  {step.name:28s} {state:8s} {step.minutes:5.0f} min{'' if step.measured else ' (planned)'}{note}")
    outside = retired(steps)
    if outside:
        print("committed results no step regenerates (remove them, git rm, once the plan is done): "
              + ", ".join(outside))
    if args.plan:
        return 0
    if version.endswith("+dirty"):
        print("error: the code has uncommitted changes (git status -- run.py setup.sh policies harness hydra_plugins "
              "conf experiments): commit them first, so that every result names code that exists", file=sys.stderr)
        return 2
    for step in steps:
        state, stale = states[step.name]
        if state == "done":
            continue
        started = time.perf_counter()
        print(f"[regenerate] {step.name}: {state}, about {step.minutes:.0f} min", flush=True)
        for cell in stale:  # made by other code: rerun, never mixed into this version's tables
            shutil.rmtree(cell) if cell.is_dir() else cell.unlink()
        for command in step.commands:
            run(command)
        print(f"[regenerate] {step.name}: {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    run((PYTHON, "-m", "harness.analysis.report"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate every committed accuracy and throughput result at one code version, over as many
sessions as it takes.

    python experiments/regenerate.py --plan          # each step: done at this version, partial, or to run
    python experiments/regenerate.py                 # run what is not done yet, in order; resumable
    python experiments/regenerate.py --only cpu_accuracy,throughput/cpu
    python experiments/regenerate.py --verify        # replay a fixed subset of every study at this code

A regeneration costs hours; a change that moves no output should not. ``--verify`` replays, for
each study, a fixed and stratified subset of its committed cells at the current code (accuracy:
full cache and one cell per budget, the policies taken in turn, four samples per task evenly spaced
through it, ``harness.run.replay``; throughput: one cell per setting, an evicting one where there
is one, ``harness.bench.replay``) and compares them with the committed outputs: every prompt and
output token (near-tie rule) and score, every count of the engine's work. A study that replays
equal is recorded as verified at this code version (``results/<study>/verified.json``: where its
cells ran, where they were verified, what was compared); RESULTS.md shows both, and the plan counts
it done. A study whose outputs moved is named with the command that regenerates it, only it.

A regeneration is only worth its hours if every table comes from the same code: it refuses to
start on a checkout whose code (``harness.records.provenance.code_version``: run.py, setup.sh, policies,
harness, hydra_plugins, conf, experiments) has uncommitted changes. Results already made at this
code version are kept, so a run interrupted at a session's end resumes where it stopped, and
commits that change only documents or results in between do not invalidate them; results made at
another code version are deleted before their step reruns (they are in git history). Each step
ends by rewriting its folder's summary; the last rewrites ``results/RESULTS.md``
(``python -m harness.analysis.report``).

A serving sweep (``results/serving/<sweep>``) is one step too: its command is the one it was made
with, its provenance its ``settings.json``, and its verification ``experiments/serving.py --verify``
(``harness.serving.experiment.verify``: its summaries recomputed from the saved runs, byte for byte,
and a sample of its requests replayed alone on a fresh ``vllm serve``); a rerun replaces its folder.

The steps are the studies of ``harness.analysis.studies`` (the one table RESULTS.md reads too), in
its order; ``minutes`` is what a step took on the 2-core CPU machine, or the estimate it is planned
with where it has not run yet.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
sys.path.insert(0, str(ROOT))

from harness.analysis.studies import Study, planned, views_of  # noqa: E402
from harness.records.provenance import code_version  # noqa: E402

PYTHON = sys.executable


@dataclass(frozen=True)
class Step:
    name: str
    folder: str  # under results/
    commands: tuple[tuple[str, ...], ...]
    minutes: float  # on the 2-core CPU machine (measured or planned, see ``measured``)
    measured: bool = False

    @property
    def serving(self) -> bool:
        return self.folder.startswith("serving/")

    def cells(self) -> list[Path]:
        """The files or run directories that carry this step's provenance."""
        root = ROOT / "results" / self.folder
        if self.serving:
            return [root / "settings.json"] if (root / "settings.json").is_file() else []
        if self.folder.startswith("throughput/"):
            return sorted((root / "cells").glob("*.json"))
        return sorted(path.parent for path in root.glob("**/config.yaml") if path.parent.name != ".hydra"
                      and (path.parent / "perf.json").exists())


def accuracy(study: Study) -> Step:
    """A sweep and its summary, and its views' summaries (further summaries of the same cells: a
    subfolder and the aggregate's options, e.g. the table without a task); ``beside``: other
    studies' folders whose cells the summaries show next to this one's (a cell both have counts once);
    ``across``: the study it repeats on another model, the two set side by side last."""
    folder = f"results/{study.folder}"
    roots = (folder, *study.beside)
    return Step(study.folder, study.folder, (
        (PYTHON, "run.py", "-m", f"+experiment={study.experiment}", f"output_dir={folder}"),
        (PYTHON, "-m", "harness.analysis.aggregate", *roots, "--out", folder),
        *((PYTHON, "-m", "harness.analysis.aggregate", *roots, "--out", f"results/{view.folder}", *view.view_options)
          for view in views_of(study)),
        *(((PYTHON, "-m", "harness.analysis.cross_model", f"results/{study.across}", folder,
            "--out", f"{folder}/across_models"),) if study.across else ()),
    ), study.minutes, study.measured)


def throughput(setting: str, minutes: float, trials: int = 3, measured: bool = False) -> Step:
    return Step(f"throughput/{setting}", f"throughput/{setting}",
                ((PYTHON, "experiments/throughput.py", setting, "--trials", str(trials)),), minutes, measured)


def serving(study: Study) -> Step:
    """A serving sweep, by the command that made it (``python experiments/serving.py ...``)."""
    command = shlex.split(study.command)
    assert command[:2] == ["python", "experiments/serving.py"], study.command
    return Step(study.folder, study.folder, ((PYTHON, *command[1:]),), study.minutes, study.measured)


# The plan of record: every study of harness.analysis.studies with its minutes, in its order.
STEPS = tuple(serving(study) if study.serving
              else throughput(study.folder.split("/", 1)[1], study.minutes, study.trials, study.measured)
              if study.throughput else accuracy(study) for study in planned())


@lru_cache(maxsize=None)
def sweep_run_dirs(overrides: tuple[str, ...]) -> frozenset[str]:
    """The run directories (relative to the repository) of the cells ``run.py -m`` expands
    ``overrides`` to: its experiment's sweep params with the command line's, each composed as the
    sweep's own callback composes them (``harness.run.sweep``), duplicates (full cache once per
    ratio) counted once. About a second per 8 cells: composed only where a step would read done."""
    from hydra import compose, initialize_config_dir

    from harness.config import run_settings
    from harness.run.sweep import sweep_cells

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        swept = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        return frozenset(str(run_settings(compose(config_name="config", overrides=cell)).run_dir)
                         for cell in sweep_cells(swept, list(overrides)))


def missing_cells(step: Step) -> list[str]:
    """An accuracy step's cells that its sweep writes and its folder does not hold (a study made in
    chunks, or cut short): with any missing, the step is not done, whatever its summary says."""
    (run, *_) = step.commands
    if "run.py" not in run:
        return []
    held = {cell.relative_to(ROOT).as_posix() for cell in step.cells()}
    return sorted(set(sweep_run_dirs(tuple(run[run.index("-m") + 1:]))) - held)


def version_of(path: Path) -> str | None:
    if path.suffix == ".json":
        return (json.loads(path.read_text()).get("provenance") or {}).get("code_version")
    config = yaml.safe_load((path / "config.yaml").read_text())
    return (config.get("provenance") or {}).get("code_version")


def verification(step: Step) -> dict | None:
    path = ROOT / "results" / step.folder / VERIFIED
    return json.loads(path.read_text()) if path.exists() else None


def status(step: Step, version: str) -> tuple[str, list[Path]]:
    """``done`` (every cell its sweep writes exists, all at this version, and its summary newer
    than them), ``verified`` (the same, with cells made at other versions replayed equal at this
    one; cells rerun at this version, such as a retrained policy's, may sit beside them),
    ``partial`` (some at this version, the others not verified or not made), ``to run``; and the
    cells made at another version."""
    state, stale = held_status(step, version)
    if state in ("done", "verified") and missing_cells(step):
        return "partial", stale
    return state, stale


def held_status(step: Step, version: str) -> tuple[str, list[Path]]:
    """``status`` of the cells the step's folder holds, whether or not they are all of its sweep."""
    cells = step.cells()
    stale = [cell for cell in cells if version_of(cell) != version]
    current = len(cells) - len(stale)
    summary = ROOT / "results" / step.folder / "summary.csv"
    newest = max((c.stat().st_mtime for c in cells), default=0)
    if cells and not stale and summary.exists() and summary.stat().st_mtime >= newest:
        return "done", stale
    record = verification(step)
    if record and step.serving:  # (a serving sweep's record: the one version its sweep ran at)
        record = {**record, "ran_at": [record["ran_at"]], "cells": 1}
    if (stale and record and record["verdict"] == "verified" and record["code_version"] == version
            and sorted({version_of(cell) for cell in stale}) == record["ran_at"] and record["cells"] == len(stale)
            and summary.exists() and summary.stat().st_mtime >= newest):
        return "verified", stale
    return ("partial" if current else "to run"), stale


def retired(steps: list[Step]) -> list[str]:
    """Result folders with a summary that no step of the full plan writes."""
    planned = {step.folder for step in STEPS}
    found = [path.parent.relative_to(ROOT / "results").as_posix()
             for path in sorted((ROOT / "results").glob("**/summary.csv"))]
    return [f"results/{folder}" for folder in found
            if folder not in planned and not any(folder.startswith(f"{p}/") for p in planned)  # a view of a study
            and not folder.startswith(("proxy_quality", "eviction_cost", "shared_context", "serving"))]


VERIFIED = "verified.json"  # in a study's folder: its last replay at a later code version
PER_TASK = 4                # samples per task an accuracy replay runs
PAPER_POLICY = "paged"      # a verification replays PagedEviction first


def prefill_settings() -> dict:
    """``experiments/throughput.py``'s prefill settings (their cells replay by ``replay_prefill_cell``)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from throughput import PREFILL_SETTINGS

    return PREFILL_SETTINGS


def replay_subset(step: Step, version: str | None = None) -> list[Path]:
    """The cells a verification replays, fixed by what is committed: for an accuracy study, full
    cache and, per budget label in reading order, one evicting cell, each budget taking the next
    policy variant not yet taken (PagedEviction's first); for a throughput setting, its first
    PagedEviction cell of trial 1 at its smallest budget, else its first evicting one, else its first on
    the patched engine. With ``version``, only cells made at another version are candidates (those
    made at it need no replay)."""
    cells = [cell for cell in step.cells() if version is None or version_of(cell) != version]
    if step.folder.startswith("throughput/"):
        stored = [(cell, json.loads(cell.read_text())["cell"]) for cell in cells]
        # trial 1, the smallest budgets first: the cells whose engine work evicts the most
        first = sorted(((cell, c) for cell, c in stored if c.get("trial", 1) == 1),
                       key=lambda pair: pair[1].get("budget") or pair[1].get("budget_ratio") or 0)
        subject = PAPER_POLICY
        if step.folder.split("/", 1)[1] in prefill_settings():  # what a prefill setting measures: its subject's passes
            subject = prefill_settings()[step.folder.split("/", 1)[1]].subject
        pick = (next((cell for cell, c in first if c["policy"] == subject), None)
                or next((cell for cell, c in first if c["policy"] != "full"), None)
                or next((cell for cell, c in first if not c.get("stock")), first[0][0]))
        return [pick]
    from harness.analysis.labels import budget_label, in_reading_order, variant_label
    import pandas as pd

    configs = {cell: yaml.safe_load((cell / "config.yaml").read_text()) for cell in cells}
    rows = pd.DataFrame([{"variant": variant_label(c), "budget": budget_label(c), "cell": cell}
                         for cell, c in configs.items()]).set_index(["variant", "budget"])
    rows = in_reading_order(rows)
    chosen = [cell for (variant, _), cell in rows["cell"].items() if variant == "full"][:1]
    taken: set[str] = set()
    evicting = rows[[variant != "full" for variant, _ in rows.index]]
    for budget in dict.fromkeys(label for _, label in evicting.index):
        here = sorted(((variant, cell) for (variant, label), cell in evicting["cell"].items() if label == budget),
                      key=lambda pair: (not pair[0].startswith(PAPER_POLICY), pair[0]))
        variant, cell = next(((v, c) for v, c in here if v not in taken), here[0])
        taken.add(variant)
        chosen.append(cell)
    return chosen


def verify(step: Step, version: str, commit: str) -> dict:
    """Replay ``replay_subset(step)`` at this code, write the study's verification, return it (a
    serving sweep: ``harness.serving.experiment.verify``, which writes its own)."""
    if step.serving:
        from harness.serving.experiment import verify as verify_sweep

        print(f"[verify] {step.name}: its summaries recomputed, a sample of its requests replayed alone", flush=True)
        record = verify_sweep(ROOT / "results" / step.folder)
        print(f"[verify] {step.name}: {record['verdict']}" + "".join(f"\n[verify]   moved: {m}" for m in record["moved"][:20])
              + ("" if record["verdict"] == "verified" else f"; regenerate it: python experiments/regenerate.py --only "
                 f"{step.name}"), flush=True)
        return record
    cells = [cell for cell in step.cells() if version_of(cell) != version]  # those made at this version need none
    ran_at = sorted({version_of(cell) for cell in cells})
    subset = replay_subset(step, version)
    print(f"[verify] {step.name}: {len(subset)} of {len(cells)} cells (made at {', '.join(ran_at)})", flush=True)
    if step.folder.startswith("throughput/"):
        import tempfile

        from harness.bench.replay import replay_cell

        from throughput import SETTINGS, replay_prefill_cell

        name = step.folder.split("/", 1)[1]
        prefill = name in prefill_settings()
        replayer, setting = (replay_prefill_cell, prefill_settings()[name]) if prefill else (replay_cell, SETTINGS[name])
        with tempfile.TemporaryDirectory() as scratch:
            compared = [replayer(setting, json.loads(cell.read_text()), Path(scratch)) for cell in subset]
        what = ("every count of the engine's work (tokens, steps, preemptions, peak blocks, evictions, freed blocks, "
                "evicted and copied tokens" + (", reconstruction tokens" if prefill else "")
                + "); timings are not compared")
    else:
        from harness.run.replay import replay

        compared = [result.as_dict() for result in replay(subset, PER_TASK, root=ROOT / "results" / step.folder)]
        what = (f"{PER_TASK} samples per task evenly spaced: prompt text, output tokens (near-tie rule), score; "
                "the likelihood passes are not replayed")
    moved = [f"{entry['cell']}: {why}" for entry in compared for why in entry["moved"]]
    record = {"study": step.name, "verdict": "moved" if moved else "verified", "code_version": version,
              "git_commit": commit, "ran_at": ran_at, "cells": len(cells), "replayed": compared, "compared": what,
              "command": f"python experiments/regenerate.py --verify --only {step.name}",
              "date": time.strftime("%Y-%m-%d")}
    (ROOT / "results" / step.folder / VERIFIED).write_text(json.dumps(record, indent=1) + "\n")
    for line in moved[:20]:
        print(f"[verify]   moved: {line}")
    samples = sum(entry.get("samples", 0) for entry in compared)
    print(f"[verify] {step.name}: {record['verdict']}" + (f" ({samples} samples)" if samples else "")
          + ("" if not moved else f"; regenerate it: python experiments/regenerate.py --only {step.name}"), flush=True)
    return record


def run(command: tuple[str, ...]) -> None:
    print("$ " + " ".join(command[1:] if command[0] == PYTHON else command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print each step's state and time, run nothing")
    parser.add_argument("--only", help="comma-separated step names (default: every step)")
    parser.add_argument("--verify", action="store_true",
                        help="replay a fixed subset of each study at this code and record it as verified if nothing moved")
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
    left = sum(step.minutes for step in steps if states[step.name][0] not in ("done", "verified"))
    print(f"code version {version}; {len(steps)} steps, about {left / 60:.1f} h left on the 2-core CPU machine")
    width = max(len(step.name) for step in steps)
    for step in steps:
        state, stale = states[step.name]
        if not stale:
            note = ""
        elif state == "verified":
            note = f", {len(stale)} made at another version and replayed equal at this one (kept)"
        else:
            note = f", {len(stale)} made at another version (deleted before it runs)"
        missing = missing_cells(step) if state == "partial" else []
        if missing:
            note += f", {len(missing)} of its sweep's cells not made yet"
        print(f"  {step.name:{width}s} {state:8s} {step.minutes:5.0f} min{'' if step.measured else ' (planned)'}{note}")
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
    if args.verify:
        from harness.records.provenance import git_commit

        records = [verify(step, version, git_commit()) for step in steps if states[step.name][0] not in ("done", "verified")]
        run((PYTHON, "-m", "harness.analysis.report"))
        return 1 if any(record["verdict"] == "moved" for record in records) else 0
    for step in steps:
        state, stale = states[step.name]
        if state in ("done", "verified"):
            continue
        started = time.perf_counter()
        print(f"[regenerate] {step.name}: {state}, about {step.minutes:.0f} min", flush=True)
        if step.serving and stale:  # a sweep's folder is one result: made again whole
            shutil.rmtree(ROOT / "results" / step.folder)
        for cell in stale if not step.serving else ():  # made by other code: rerun, never mixed into this version's tables
            shutil.rmtree(cell) if cell.is_dir() else cell.unlink()
        for command in step.commands:
            run(command)
        print(f"[regenerate] {step.name}: {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    run((PYTHON, "-m", "harness.analysis.report"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

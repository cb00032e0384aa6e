"""The committed CI baseline (``results/ci_baseline/``, made by ``+experiment=ci_regression`` with one
engine per cell) as the tests read it: its cells and their policies come from disk, never from the
registry, so a newly registered score changes no count here; ``coverage_problems`` is the one check
that the baseline holds every registered policy, and says how to add the missing cells."""
from __future__ import annotations

from pathlib import Path

import yaml

from policies import REGISTRY
from tests.support import ROOT

CI_BASELINE = ROOT / "results" / "ci_baseline"


def swept_policies() -> list[str]:
    """What ``${kv_policies:}`` sweeps: every registered policy but the aliases and those that
    reconstruct (KVzip), in registry order."""
    return [name for name, entry in REGISTRY.items() if entry.alias_of is None and not entry.reconstructs]


def baseline_cells() -> list[Path]:
    """The committed cells' run directories."""
    return sorted(p.parent for p in CI_BASELINE.rglob("predictions.jsonl"))


def cell_policy(cell: Path) -> str:
    return yaml.safe_load((cell / "config.yaml").read_text())["policy"]["name"]


def baseline_policies() -> list[str]:
    """The policies the committed cells ran, sorted."""
    return sorted({cell_policy(cell) for cell in baseline_cells()})


def add_cells_command(policies: list[str]) -> str:
    """Adds the baseline cells of ``policies`` only (full cache's is skipped when complete), one engine
    per cell as the baseline was made; every other cell stays as committed."""
    return (".venv/bin/python run.py -m +experiment=ci_regression policy=" + ",".join(policies)
            + " output_dir=results/ci_baseline hydra/launcher=basic")


def coverage_problems() -> list[str]:
    """Why the committed baseline does not hold exactly the swept policies (empty when it does)."""
    swept, committed = swept_policies(), baseline_policies()
    missing = [name for name in swept if name not in committed]
    extra = [name for name in committed if name not in swept]
    problems = []
    if missing:
        problems.append(
            f"registered policies without cells in results/ci_baseline: {', '.join(missing)}. Add their cells "
            f"(two per policy, budgets 256 and 512, one engine each: minutes per cell on CPU) and commit them:\n"
            f"    {add_cells_command(missing)}")
    if extra:
        cells = [str(cell.relative_to(ROOT)) for cell in baseline_cells() if cell_policy(cell) in extra]
        problems.append(f"results/ci_baseline has cells of policies no longer registered ({', '.join(extra)}): "
                        f"remove {' '.join(cells)}")
    return problems


def cell_stem(name: str) -> str:
    """A cell's name without its configuration's digest (``paged_b256_bs32``): what a rerun of the
    baseline's cell on fewer samples (another ``data.limit``, so another digest) shares with it."""
    return name.rsplit("_", 1)[0]


def compare_first_samples(candidate: Path, per_task: int) -> list[str]:
    """``harness.analysis.regression.compare`` for a rerun of the baseline's sweep on each task's
    first ``per_task`` samples (``data.limit``): every baseline cell has its rerun, each with exactly
    those samples of the baseline cell, and every one of them is the same greedy decoding under the
    near-tie rule (``parting``). Empty when all hold; else one line per problem."""
    from harness.analysis.regression import cells, parting
    from harness.records.results import read_jsonl

    want = {cell_stem(name): path for name, path in cells(CI_BASELINE).items()}
    got = {cell_stem(name): path for name, path in cells(candidate).items()}
    problems = [f"{name}: missing from {candidate}" for name in sorted(set(want) - set(got))]
    problems += [f"{name}: not in the reference" for name in sorted(set(got) - set(want))]
    for name in sorted(set(want) & set(got)):
        reference = read_jsonl(want[name] / "predictions.jsonl")
        first = [row for task in dict.fromkeys(row["task"] for row in reference)
                 for row in [r for r in reference if r["task"] == task][:per_task]]
        expected = {row["id"]: row for row in first}
        measured = {row["id"]: row for row in read_jsonl(got[name] / "predictions.jsonl")}
        if set(expected) != set(measured):
            problems.append(f"{name}: samples differ ({sorted(set(expected) ^ set(measured))[:5]})")
        for sample in sorted(set(expected) & set(measured)):
            a, b = expected[sample], measured[sample]
            why = parting(a["output_token_ids"], b["output_token_ids"], a["top_logprobs"], b["top_logprobs"])
            if why:
                problems.append(f"{name} {sample}: {why}")
    return problems

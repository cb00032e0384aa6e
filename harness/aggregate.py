"""Run directories -> one pandas DataFrame -> ``summary.csv`` and ``summary.md`` (+ plots).

    python -m harness.aggregate results/runs [more dirs] --out results/summary

One row per (run, task), every config key as a column (``policy.name``, ``budget``, ``model.name``,
...), with the task score, the run's average, fidelity to full cache, throughput, latency and KV
memory. Retention is a policy's score as a percentage of the full-cache score of the same model,
data and task; throughput ratios are against the same model and data's full-cache run.

Every score carries its 95% bootstrap interval (``score_low``/``score_high``, ``average_low``/
``average_high``, from the per-sample scores in ``predictions.jsonl``; ``harness.stats``), and
every run its paired differences, sample by sample, against full cache and against each other
policy at the same budget: ``vs_<policy>_diff``/``_low``/``_high`` per task and
``avg_vs_<policy>_diff``/``_low``/``_high`` for the average (this run minus that one).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from harness.results import RUN_FILES, atomic_write_text, is_complete, read_json, read_jsonl
from harness.stats import Interval, intervals

RUN_KEYS = ["model.name", "data.name", "policy.name", "budget", "block_size"]


def variant_label(config: dict) -> str:
    """The policy's name plus whatever makes this run differ from its defaults: options away from
    the policy's own defaults and a block size other than the engine's (``paged[per_head=True]``,
    ``paged[block_size=64]``). Tables and plots key rows by it, so ablations read apart."""
    from policies import REGISTRY, default_options

    policy = config.get("policy") or {}
    name = policy.get("name", "?")
    defaults = default_options(name) if name in REGISTRY else {}
    missing = object()
    changed = [f"{key}={value}" for key, value in sorted((policy.get("options") or {}).items())
               if defaults.get(key, missing) != value]
    if config.get("decode_eviction") is False and name != "full":
        changed.append("decode_eviction=False")  # the prompt compressed only
    engine_block = (config.get("engine") or {}).get("block_size")
    if engine_block is not None and config.get("block_size") not in (None, engine_block):
        changed.append(f"block_size={config['block_size']}")
    return name + (f"[{', '.join(changed)}]" if changed else "")


def find_runs(roots: list[Path]) -> list[Path]:
    found = set()
    for root in roots:
        for config in root.rglob(RUN_FILES[0]):
            if is_complete(config.parent) and not config.parent.name.endswith(".partial"):
                found.add(config.parent)
    return sorted(found)


def flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif not isinstance(value, list):
            flat[name] = value
    return flat


def run_rows(run_dir: Path) -> list[dict]:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config.pop("provenance", None)
    scores, perf = read_json(run_dir / "scores.json"), read_json(run_dir / "perf.json")
    base = flatten(config)
    base["variant"] = variant_label(config)
    if base.get("policy.name") == "full":
        base["budget"] = None  # full cache keeps everything, whatever the configured budget
        base["budget_ratio"] = None
    fidelity = scores.get("fidelity") or {}
    kv = perf.get("kv") or {}
    base.update({
        "run_dir": str(run_dir),
        "average": scores.get("average"),
        "fidelity_exact_match": fidelity.get("exact_match"),
        "fidelity_rougeL": fidelity.get("rougeL_f"),
        "isolated": perf.get("isolated", True),
        "output_tokens_per_s": perf.get("output_tokens_per_s"),
        "total_tokens_per_s": perf.get("total_tokens_per_s"),
        "ttft_p50_s": (perf.get("ttft_s") or {}).get("p50"),
        "tpot_p50_s": (perf.get("tpot_s") or {}).get("p50"),
        "latency_p50_s": (perf.get("latency_s") or {}).get("p50"),
        "kv_blocks_peak": kv.get("kv_blocks_used_peak"),
        "kv_blocks_mean": kv.get("kv_blocks_used_mean"),
        "running_peak": kv.get("running_requests_peak"),
        "evict_share": kv.get("evict_share_of_step"),
        "preemptions": perf.get("preemptions"),
    })
    rows = []
    for task, entry in scores["tasks"].items():
        row = dict(base, task=task, metric=entry["metric"], samples=entry["samples"], score=entry["score"])
        row["task_fidelity_rougeL"] = (fidelity.get("tasks") or {}).get(task, {}).get("rougeL_f")
        rows.append(row)
    return rows


def load_runs(roots: list[Path]) -> pd.DataFrame:
    rows = [row for run in find_runs(roots) for row in run_rows(run)]
    if not rows:
        raise FileNotFoundError(f"no complete run directory under {', '.join(map(str, roots))}")
    frame = pd.DataFrame(rows)
    return add_intervals(add_relative_columns(frame))


def sample_scores(run_dir: str) -> dict[str, pd.Series]:
    """Per task, each sample's score in [0, 1] indexed by sample id (``predictions.jsonl``)."""
    rows = pd.DataFrame(read_jsonl(Path(run_dir) / "predictions.jsonl"))
    return {task: group.set_index("id")["score"].astype(float) for task, group in rows.groupby("task")}


def paired(run: dict[str, pd.Series], other: dict[str, pd.Series]) -> dict[str, np.ndarray]:
    """Per task, this run's minus the other's score on the samples both scored."""
    differences = {}
    for task in sorted(set(run) & set(other)):
        common = run[task].index.intersection(other[task].index)
        if len(common):
            differences[task] = (run[task][common] - other[task][common]).to_numpy()
    return differences


def add_intervals(frame: pd.DataFrame) -> pd.DataFrame:
    """Interval columns for every score and every paired difference (see the module docstring)."""
    samples = {run: sample_scores(run) for run in frame["run_dir"].unique()}
    runs = frame.drop_duplicates("run_dir").set_index("run_dir")
    columns: dict[tuple[str, str], dict[str, float]] = {}  # (run_dir, task or "") -> values

    def put(run: str, task: str, prefix: str, interval: Interval) -> None:
        cell = columns.setdefault((run, task), {})
        cell.update({f"{prefix}_low": interval.low, f"{prefix}_high": interval.high})
        if prefix not in ("score", "average"):
            cell[f"{prefix}_diff"] = interval.estimate

    for run, info in runs.iterrows():
        tasks, average = intervals({t: v.to_numpy() for t, v in samples[run].items()})
        for task, interval in tasks.items():
            put(run, task, "score", interval)
        put(run, "", "average", average)
        for other, other_info in runs.iterrows():
            same_setting = (other_info["model.name"], other_info["data.name"]) == (info["model.name"], info["data.name"])
            comparable = other_info["policy.name"] == "full" or budget_label(other_info) == budget_label(info)
            if other == run or not same_setting or not comparable or info["variant"] == other_info["variant"]:
                continue
            differences = paired(samples[run], samples[other])
            if not differences:
                continue
            tasks, average = intervals(differences)
            for task, interval in tasks.items():
                put(run, task, f"vs_{other_info['variant']}", interval)
            put(run, "", f"avg_vs_{other_info['variant']}", average)
    per_task = pd.DataFrame([dict(run_dir=r, task=t, **v) for (r, t), v in columns.items() if t])
    per_run = pd.DataFrame([dict(run_dir=r, **v) for (r, t), v in columns.items() if not t])
    return frame.merge(per_task, on=["run_dir", "task"], how="left").merge(per_run, on="run_dir", how="left")


def add_relative_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Retention (score vs full cache) and throughput ratio, per model, data and task; retention of the
    run's average score per model and data."""
    group = ["model.name", "data.name", "task"]
    full = frame[frame["policy.name"] == "full"].set_index(group)
    full_score = full["score"][~full.index.duplicated()]
    full_speed = full["output_tokens_per_s"][~full.index.duplicated()]
    keys = pd.MultiIndex.from_frame(frame[group])
    reference_score = full_score.reindex(keys).to_numpy()
    reference_speed = full_speed.reindex(keys).to_numpy()
    frame["retention_pct"] = (100 * frame["score"] / reference_score).round(1)
    frame.loc[reference_score == 0, "retention_pct"] = None
    frame["throughput_vs_full"] = (frame["output_tokens_per_s"] / reference_speed).round(2)
    # The same for the run's average score, per model and data (full cache's average is one number).
    runs = full.reset_index().drop_duplicates(["model.name", "data.name"]).set_index(["model.name", "data.name"])
    reference_average = runs["average"].reindex(pd.MultiIndex.from_frame(frame[["model.name", "data.name"]])).to_numpy()
    frame["retention_avg_pct"] = (100 * frame["average"] / reference_average).round(1)
    frame.loc[reference_average == 0, "retention_avg_pct"] = None
    return frame


ROW = ["variant", "budget"]  # how tables key their rows: the policy variant and the budget label


def budget_label(row) -> str:
    """A run's budget as a label: the token count, ``r0.5`` for a compression ratio (share of each
    prompt removed), or "all" for full cache (it keeps every token)."""
    ratio = row.get("budget_ratio")
    if ratio is not None and ratio == ratio:
        return f"r{ratio:g}"
    budget = row.get("budget")
    return "all" if budget is None or budget != budget else str(int(budget))


def with_budget_label(frame: pd.DataFrame) -> pd.DataFrame:
    """``budget`` as a label (``budget_label``)."""
    labelled = frame.copy()
    labelled["budget"] = [budget_label(row) for _, row in frame.iterrows()]
    return labelled


def in_reading_order(table: pd.DataFrame) -> pd.DataFrame:
    """Rows (variant, budget label): full cache first, then each variant by name, budgets ascending."""
    def key(row):
        policy, budget = row
        order = int(budget) if budget.isdigit() else float(budget[1:]) if budget.startswith("r") else -1
        return (policy != "full", policy, budget.startswith("r"), order)

    return table.loc[sorted(table.index, key=key)]


def score_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Task scores: rows policy x budget, one column per task, then the average."""
    frame = with_budget_label(frame)
    table = frame.pivot_table(index=ROW, columns="task", values="score")
    table["average"] = frame.groupby(ROW)["average"].first()
    return in_reading_order(table.round(2))


def system_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per run: what the policy kept (retention of the average score, fidelity) and what it bought."""
    columns = ["retention_avg_pct", "fidelity_exact_match", "fidelity_rougeL", "output_tokens_per_s",
               "throughput_vs_full", "tpot_p50_s", "kv_blocks_peak", "kv_blocks_mean", "evict_share"]
    runs = with_budget_label(frame.drop_duplicates("run_dir"))
    return in_reading_order(runs.set_index(ROW)[columns].round(3))


def markdown_table(table: pd.DataFrame) -> str:
    """A policy x budget table with ``policy`` and ``budget`` as plain columns (no tuple labels)."""
    return table.reset_index().rename(columns={"variant": "policy"}).to_markdown(index=False)


def with_interval(value, low, high) -> str:
    return f"{value:.1f} ({low:.1f}, {high:.1f})"


def interval_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Task scores and the average with their 95% intervals, as text: ``score (low, high)``."""
    labelled = with_budget_label(frame)
    cells = {}
    for (policy, budget), group in labelled.groupby(ROW):
        row = {task: with_interval(r["score"], r["score_low"], r["score_high"]) for task, r in group.set_index("task").iterrows()}
        first = group.iloc[0]
        row["average"] = with_interval(first["average"], first["average_low"], first["average_high"])
        cells[(policy, budget)] = row
    table = pd.DataFrame.from_dict(cells, orient="index")
    table.index.names = ROW
    return in_reading_order(table[sorted(c for c in table.columns if c != "average") + ["average"]])


def differences_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Paired differences of the average, row policy minus column policy (full cache, then the
    other policies at the same budget), with 95% intervals; ``*`` marks a significant one."""
    runs = with_budget_label(frame.drop_duplicates("run_dir"))
    runs = runs[runs["policy.name"] != "full"]
    others = ["full"] + sorted(runs["variant"].unique())
    cells = {}
    for _, run in runs.iterrows():
        row = {}
        for other in others:
            if f"avg_vs_{other}_diff" in run and run[f"avg_vs_{other}_diff"] == run[f"avg_vs_{other}_diff"]:
                low, high = run[f"avg_vs_{other}_low"], run[f"avg_vs_{other}_high"]
                mark = " *" if low > 0 or high < 0 else ""
                # Two decimals: a bound just below zero must not print as "-0.0" beside its mark.
                row[f"minus {other}"] = f"{run[f'avg_vs_{other}_diff']:+.2f} ({low:+.2f}, {high:+.2f}){mark}"
            else:
                row[f"minus {other}"] = ""
        cells[(run["variant"], run["budget"])] = row
    table = pd.DataFrame.from_dict(cells, orient="index")
    table.index.names = ROW
    return in_reading_order(table)


def shared_engine_note(frame: pd.DataFrame) -> list[str]:
    """Timings of cells that shared one engine are the group's, not an isolated run's: say so."""
    shared = frame.drop_duplicates("run_dir")
    shared = shared[~shared["isolated"].fillna(True).astype(bool)] if "isolated" in shared else shared.iloc[:0]
    if shared.empty:
        return []
    return [f"Timing, KV-block and eviction-share columns of {len(shared)} run(s) are those of an engine "
            "shared by the sweep's cells (each prompt prefilled once, every cell's requests batched together; "
            "`perf.json` `isolated: false`): they are not comparable with isolated runs. Throughput and memory "
            "comparisons come from `experiments/throughput.py`.", ""]


def to_markdown(frame: pd.DataFrame, command: str) -> str:
    parts = []
    for (model, data), group in frame.groupby(["model.name", "data.name"]):
        per_task = group.drop_duplicates("task").set_index("task")["samples"]
        counts = ", ".join(f"{task} {int(n)}" for task, n in per_task.items())
        parts += [
            f"## {model} on {data}",
            "",
            "Task scores (LongBench metrics, 0-100) with 95% bootstrap intervals over samples; `average` is the "
            f"unweighted mean of the task scores (its interval resamples within tasks). Samples per task: {counts}.",
            "",
            markdown_table(interval_table(group)),
            "",
            "Paired differences of the average score (row minus column, same samples), 95% bootstrap intervals; "
            "`*` marks a difference whose interval excludes zero. Columns other than full cache compare "
            "policies at the row's budget.",
            "",
            markdown_table(differences_table(group)),
            "",
            "Retention of the average score against full cache (%), fidelity to full cache (%), throughput "
            "(output tokens/s and ratio to full cache), median time per output token (s), KV blocks in use "
            "(peak, mean), eviction work as a share of step time.",
            "",
            markdown_table(system_table(group)),
            "",
            *shared_engine_note(group),
        ]
    return "\n".join([f"# Summary\n\nProduced by `{command}`\n", *parts])


def write_summary(frame: pd.DataFrame, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "summary.csv", frame.to_csv(index=False))
    atomic_write_text(out / "summary.md", to_markdown(frame, command))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/summary"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    frame = load_runs(args.roots)
    command = "python -m harness.aggregate " + " ".join(argv)
    write_summary(frame, args.out, command)
    if not args.no_plots:
        from harness.plots import plot_all

        plot_all(frame, args.out)
    print(to_markdown(frame, command))
    print(f"[aggregate] {len(frame)} rows from {frame['run_dir'].nunique()} runs -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

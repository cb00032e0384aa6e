"""Rescore stored runs with the metrics as they are now, without generating anything again.

A run's predictions are facts about the model; its scores are a rule applied to them. When a rule
changes (key_retrieval moved from token F1 to RULER's string_match_all), the committed runs are
rescored from their ``predictions.jsonl``:

    python -m harness.scoring.rescore results/cpu_accuracy results/ablation
    python -m harness.scoring.rescore --check results/cpu_accuracy   # exit 1 if any score is stale

Two files carry scores, and both are rewritten so that they agree: each row's ``score`` in
``predictions.jsonl`` (what ``harness.analysis.aggregate`` computes intervals and paired differences from)
and ``scores.json`` (the per-task scores and average, by ``harness.scoring.report.score_run``, the
same function a run uses). Everything in ``scores.json`` that does not depend on the metric
(likelihood, fidelity to full cache, skipped samples) is kept as it was, and ``rescored`` records
the commit that rescored it and what changed, since ``config.yaml``'s provenance names the commit
that generated the predictions. Unchanged runs are not touched. Summaries are not regenerated
here: run ``python -m harness.analysis.aggregate`` on the same roots afterwards.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.scoring.report import score_run
from harness.records.provenance import git_commit
from harness.records.results import atomic_write_text, is_complete, read_json, read_jsonl



def run_directories(paths: list[Path]) -> list[Path]:
    """Each path that is a complete run directory, else every complete one under it."""
    found: list[Path] = []
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        candidates = [path] if is_complete(path) else sorted(p.parent for p in path.rglob("predictions.jsonl"))
        found += [c for c in candidates if is_complete(c) and not c.name.endswith(".partial")]
    if not found:
        raise FileNotFoundError(f"no complete run directory (config.yaml, predictions.jsonl, scores.json, perf.json) "
                                f"in or under {', '.join(map(str, paths))}")
    return list(dict.fromkeys(found))


def rescore(run_dir: Path) -> tuple[list[dict], dict, dict]:
    """The run's rows and ``scores.json`` under the current metrics, and the old scores."""
    old = read_json(run_dir / "scores.json")
    rows = read_jsonl(run_dir / "predictions.jsonl")
    new = dict(old)
    new.update(score_run(rows, old.get("skipped_samples", [])))  # sets each row's "score" too
    return rows, new, old


def changes(old: dict, new: dict) -> dict[str, dict]:
    """Per task whose metric or score moved: old and new of each."""
    moved = {}
    for task, entry in new["tasks"].items():
        before = old.get("tasks", {}).get(task, {})
        if (before.get("metric"), before.get("score")) != (entry["metric"], entry["score"]):
            moved[task] = {"metric": [before.get("metric"), entry["metric"]], "score": [before.get("score"), entry["score"]]}
    return moved


def stale_rows(run_dir: Path, rows: list[dict]) -> int:
    """Rows whose stored per-sample score differs from the current metric's."""
    stored = read_jsonl(run_dir / "predictions.jsonl")
    return sum(a.get("score") != b["score"] for a, b in zip(stored, rows))


def write(run_dir: Path, rows: list[dict], scores: dict, moved: dict) -> None:
    scores = {key: scores[key] for key in scores if key != "rescored"}
    scores["rescored"] = {"git_commit": git_commit(), "by": "harness.scoring.rescore", "changed": moved}
    # Same serialisation as harness.records.results.RunWriter: unchanged rows stay byte for byte.
    atomic_write_text(run_dir / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(run_dir / "scores.json", json.dumps(scores, indent=2, sort_keys=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.scoring.rescore", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, or folders searched for them")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any run's scores are stale")
    args = parser.parse_args(argv)
    try:
        runs = run_directories(args.paths)
    except FileNotFoundError as error:
        print(f"rescore: {error}", file=sys.stderr)
        return 2
    stale = 0
    for run_dir in runs:
        rows, new, old = rescore(run_dir)
        moved, rows_moved = changes(old, new), stale_rows(run_dir, rows)
        if not moved and not rows_moved and old.get("average") == new["average"]:
            continue
        stale += 1
        detail = "; ".join(f"{task} {m['metric'][0]}->{m['metric'][1]} {m['score'][0]}->{m['score'][1]}"
                           for task, m in moved.items()) or "per-sample scores only"
        print(f"{run_dir}: {detail}; average {old.get('average')}->{new['average']}; {rows_moved} sample score(s)")
        if not args.check:
            write(run_dir, rows, new, moved)
    verb = "stale" if args.check else "rescored"
    print(f"{stale} of {len(runs)} run(s) {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

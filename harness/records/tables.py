"""Tables that read well in a terminal and in Markdown (GitHub pipe tables)."""
from __future__ import annotations

from tabulate import tabulate


def scores_table(scores: dict, title: str = "") -> str:
    rows = [
        [task, entry["metric"], entry["samples"], f"{entry['score']:.2f}"]
        for task, entry in scores["tasks"].items()
    ]
    rows.append(["average", "mean of tasks", scores["samples"], f"{scores['average']:.2f}"])
    table = tabulate(rows, headers=["task", "metric", "samples", "score (0-100)"], tablefmt="github")
    skipped = f"\n{scores['skipped']} sample(s) skipped (see scores.json)" if scores["skipped"] else ""
    return (f"\n{title}\n" if title else "\n") + table + skipped

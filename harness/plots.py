"""Trade-off pictures from the aggregated DataFrame, as PNG and PDF.

* score vs budget, one panel per task, one line per policy with its 95% intervals as error bars,
  full cache dashed with its interval as a grey band;
* output throughput vs budget, full cache dashed;
* accuracy (average score, with its interval) vs throughput, one point per run.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: works without a screen, in CI and notebooks alike
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

def color(label: str):
    """One colour per registered policy, by registry order (full cache black): a new policy gets
    its own with no edit here. ``label`` may be a variant, ``paged[per_head=True]``."""
    from policies import REGISTRY

    name = label.split("[")[0]
    if name == "full":
        return "black"
    names = [n for n in REGISTRY if n != "full"]
    return plt.get_cmap("tab20")(names.index(name) % 20) if name in names else None


def _save(fig, out: Path, name: str) -> list[Path]:
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, bbox_inches="tight", dpi=130)
    plt.close(fig)
    return paths


def _against_budget(ax, frame: pd.DataFrame, column: str, ylabel: str) -> None:
    """One line per policy over the budget, full cache as a dashed reference, on a log-2 budget
    axis labelled in plain tokens (budgets double from one setting to the next). Where the frame
    has ``<column>_low``/``_high`` (95% intervals), they are drawn as error bars and a band."""
    from matplotlib.ticker import ScalarFormatter

    bounds = [f"{column}_low", f"{column}_high"]
    has_bounds = all(b in frame for b in bounds)
    policies = list(_policies(frame))
    for index, (policy, group) in enumerate(policies):
        errors = [group[column] - group[bounds[0]], group[bounds[1]] - group[column]] if has_bounds else None
        dodge = 2 ** (0.04 * (index - (len(policies) - 1) / 2)) if has_bounds else 1  # bars side by side
        ax.errorbar(group["budget"] * dodge, group[column], yerr=errors, marker="o", capsize=3, label=policy,
                    color=color(policy))
    full = frame[frame["policy.name"] == "full"]
    if len(full):
        ax.axhline(full[column].iloc[0], linestyle="--", color="black", label="full cache")
        if has_bounds:
            ax.axhspan(full[bounds[0]].iloc[0], full[bounds[1]].iloc[0], color="grey", alpha=0.15, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(frame["budget"].dropna().unique()))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("KV budget (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _policies(frame: pd.DataFrame):
    # Runs aggregated by harness.aggregate carry a variant label; the throughput table only names policies.
    key = "variant" if "variant" in frame else "policy.name"
    for policy, group in frame[frame["policy.name"] != "full"].groupby(key):
        yield policy, group.sort_values("budget")


def score_vs_budget(frame: pd.DataFrame, title: str):
    tasks = sorted(frame["task"].unique())
    columns = min(3, len(tasks))
    rows = -(-len(tasks) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        _against_budget(ax, frame[frame["task"] == task], "score", "score (0-100)")
        ax.set_title(task)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def throughput_vs_budget(runs: pd.DataFrame, title: str):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    _against_budget(ax, runs, "output_tokens_per_s", "output tokens / s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def accuracy_vs_throughput(runs: pd.DataFrame, title: str):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for policy, group in runs.groupby("variant"):
        if "average_low" in group:
            ax.errorbar(group["output_tokens_per_s"], group["average"], fmt="none", capsize=2, alpha=0.5,
                        yerr=[group["average"] - group["average_low"], group["average_high"] - group["average"]],
                        color=color(policy))
        ax.scatter(group["output_tokens_per_s"], group["average"], label=policy, color=color(policy),
                   marker="*" if policy == "full" else "o", s=90 if policy == "full" else 40)
        for _, row in group.iterrows():
            if pd.notna(row["budget"]):
                ax.annotate(str(int(row["budget"])), (row["output_tokens_per_s"], row["average"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("output tokens / s")
    ax.set_ylabel("average score (0-100, 95% interval)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_all(frame: pd.DataFrame, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (model, data), group in frame.groupby(["model.name", "data.name"]):
        runs = group.drop_duplicates("run_dir")
        stem = f"{model}_{data}"
        written += _save(score_vs_budget(group, f"Score vs KV budget: {model} on {data}"), out, f"{stem}_score_vs_budget")
        written += _save(throughput_vs_budget(runs, f"Throughput vs KV budget: {model} on {data}"), out, f"{stem}_throughput")
        written += _save(accuracy_vs_throughput(runs, f"Accuracy vs throughput: {model} on {data}"), out, f"{stem}_tradeoff")
    return written

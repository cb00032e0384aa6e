"""Trade-off pictures from the aggregated DataFrame, as PNG and PDF.

* score vs budget, one panel per task, one line per policy with its 95% intervals as error bars,
  full cache dashed with its interval as a grey band;
* output throughput vs budget, full cache dashed;
* accuracy (average score, with its interval) vs throughput, one point per run;
* where samples record their needle's depth (RULER's single-needle tasks): a needle heatmap per
  budget, score by depth (10 bands) and sample length in tokens, one panel per policy.
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
    # KVzip (registered after the committed figures were drawn, between knorm and learned by module
    # name) takes its colour after every other, so that no committed figure's colours change.
    names = [n for n in names if n != "kvzip"] + (["kvzip"] if "kvzip" in names else [])
    return plt.get_cmap("tab20")(names.index(name) % 20) if name in names else None


def _save(fig, out: Path, name: str) -> list[Path]:
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        # No creation date in the PDF: the same results give the same bytes (a rerun is no diff).
        metadata = {"CreationDate": None} if path.suffix == ".pdf" else None
        fig.savefig(path, bbox_inches="tight", dpi=130, metadata=metadata)
    plt.close(fig)
    return paths


def _against_budget(ax, frame: pd.DataFrame, column: str, ylabel: str, x: str = "budget") -> None:
    """One line per policy over the budget, full cache as a dashed reference, on a log-2 budget
    axis labelled in plain tokens (budgets double from one setting to the next), or over the
    compression ratio (``x="budget_ratio"``, linear). Where the frame has ``<column>_low``/``_high``
    (95% intervals), they are drawn as error bars and a band."""
    from matplotlib.ticker import ScalarFormatter

    bounds = [f"{column}_low", f"{column}_high"]
    has_bounds = all(b in frame for b in bounds)
    policies = list(_policies(frame, x))
    for index, (policy, group) in enumerate(policies):
        errors = [group[column] - group[bounds[0]], group[bounds[1]] - group[column]] if has_bounds else None
        offset = (index - (len(policies) - 1) / 2) if has_bounds else 0  # bars side by side
        where = group[x] * 2 ** (0.04 * offset) if x == "budget" else group[x] + 0.01 * offset
        ax.errorbar(where, group[column], yerr=errors, marker="o", capsize=3, label=policy, color=color(policy))
    full = frame[frame["policy.name"] == "full"]
    if len(full):
        ax.axhline(full[column].iloc[0], linestyle="--", color="black", label="full cache")
        if has_bounds:
            ax.axhspan(full[bounds[0]].iloc[0], full[bounds[1]].iloc[0], color="grey", alpha=0.15, lw=0)
    if x == "budget":
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(frame["budget"].dropna().unique()))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("KV budget (tokens)")
    else:
        ax.set_xticks(sorted(frame[x].dropna().unique()))
        ax.set_xlabel("compression ratio (share of the prompt removed)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _policies(frame: pd.DataFrame, x: str = "budget"):
    # Runs aggregated by harness.analysis.aggregate carry a variant label; the throughput table only names policies.
    key = "variant" if "variant" in frame else "policy.name"
    for policy, group in frame[(frame["policy.name"] != "full") & frame[x].notna()].groupby(key):
        yield policy, group.sort_values(x)


def score_vs_budget(frame: pd.DataFrame, title: str, x: str = "budget"):
    tasks = sorted(frame["task"].unique())
    columns = min(3, len(tasks))
    rows = -(-len(tasks) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        _against_budget(ax, frame[frame["task"] == task], "score", "score (0-100)", x)
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
            if row["policy.name"] != "full":
                from harness.analysis.labels import budget_label

                ax.annotate(budget_label(row), (row["output_tokens_per_s"], row["average"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("output tokens / s")
    ax.set_ylabel("average score (0-100, 95% interval)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


DEPTH_BANDS = 10


def depth_samples(runs: pd.DataFrame) -> pd.DataFrame:
    """Per sample of each run that recorded a needle depth: variant, budget label, depth band,
    length and score."""
    from harness.analysis.labels import with_budget_label
    from harness.records.results import read_jsonl

    rows = []
    for _, run in with_budget_label(runs).iterrows():
        for record in read_jsonl(Path(run["run_dir"]) / "predictions.jsonl"):
            if record.get("depth") is not None:
                band = min(int(record["depth"] / (100 / DEPTH_BANDS)), DEPTH_BANDS - 1)
                rows.append({"variant": run["variant"], "budget": run["budget"], "band": band,
                             "length": record["length"], "score": 100 * record["score"]})
    return pd.DataFrame(rows)


def split_variant(variant: str) -> tuple[str, list[str]]:
    """A variant label's policy name and options: ``h2o[decode_eviction=False]`` -> ("h2o",
    ["decode_eviction=False"])."""
    name, _, options = variant.partition("[")
    return name, [o for o in options.rstrip("]").split(", ") if o]


def panel_titles(variants: list[str], budget: str, width: int = 24) -> tuple[list[str], list[str]]:
    """Short panel titles for one figure's variants, and the options every evicting one shares.

    A title is the policy and the budget (``h2o r0.5``) with the options that set this panel apart
    from the others, wrapped at ``width`` characters under it; options shared by every panel but
    full cache (``decode_eviction=False`` on RULER) are said once, for the figure's title: spelled
    out in each title, ``h2o[decode_eviction=False] r0.5`` ran into its neighbours."""
    import textwrap

    evicting = [split_variant(v)[1] for v in variants if v != "full"]
    common = [o for o in evicting[0] if all(o in options for options in evicting)] if evicting else []
    shown = budget if budget.startswith("r") else f"b{budget}"
    titles = []
    for variant in variants:
        if variant == "full":
            titles.append("full")
            continue
        name, options = split_variant(variant)
        rest = [o for o in options if o not in common]
        extra = textwrap.wrap("[" + ", ".join(rest) + "]", width) if rest else []
        titles.append("\n".join([f"{name} {shown}", *extra]))
    return titles, common


def needle_heatmaps(runs: pd.DataFrame, title: str) -> list[tuple[str, "plt.Figure"]]:
    """Per budget, one panel per policy (full cache first): mean score by depth band (rows, 0% =
    the context's start) and length (columns), the classic needle-in-a-haystack picture. Panel
    titles name the policy and budget (``panel_titles``); options every evicting panel shares are
    in the figure's title."""
    samples = depth_samples(runs)
    figures = []
    if samples.empty:
        return figures
    lengths = sorted(samples["length"].unique())
    full = samples[samples["variant"] == "full"]
    for budget in sorted(b for b in samples["budget"].unique() if b != "all"):
        shown = pd.concat([full, samples[samples["budget"] == budget]])
        variants = ["full"] * (not full.empty) + sorted(v for v in shown["variant"].unique() if v != "full")
        titles, common = panel_titles(variants, budget)
        fig, axes = plt.subplots(1, len(variants), figsize=(2.2 * len(variants) + 1, 3.6), squeeze=False, sharey=True,
                                 layout="constrained")
        for ax, variant, panel in zip(axes[0], variants, titles):
            grid = (shown[shown["variant"] == variant].pivot_table(index="band", columns="length", values="score")
                    .reindex(index=range(DEPTH_BANDS), columns=lengths))
            image = ax.imshow(grid.to_numpy(), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
            ax.set_title(panel, fontsize=8)
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths], fontsize=7)
            ax.set_xlabel("length (tokens)", fontsize=7)
        axes[0][0].set_yticks(range(DEPTH_BANDS), [f"{b * 100 // DEPTH_BANDS}%" for b in range(DEPTH_BANDS)], fontsize=7)
        axes[0][0].set_ylabel("needle depth", fontsize=8)
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="score (0-100)")
        shared = f"; every policy but full cache with {', '.join(common)}" if common else ""
        fig.suptitle(f"{title}, budget {budget}{shared} (blank: no sample)", fontsize=9)
        figures.append((budget, fig))
    return figures


def plot_all(frame: pd.DataFrame, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (model, data), group in frame.groupby(["model.name", "data.name"]):
        stem = f"{model}_{data}"
        every_run = group.drop_duplicates("run_dir")
        by_ratio = group["budget_ratio"].notna() if "budget_ratio" in group else pd.Series(False, index=group.index)
        if by_ratio.any():  # runs that set their budget as a compression ratio, beside full cache
            with_full = pd.concat([group[group["policy.name"] == "full"], group[by_ratio]])
            written += _save(score_vs_budget(with_full, f"Score vs compression ratio: {model} on {data}", "budget_ratio"),
                             out, f"{stem}_score_vs_ratio")
        by_tokens = group[~by_ratio]
        if (by_tokens["policy.name"] != "full").any() or not by_ratio.any():
            runs = by_tokens.drop_duplicates("run_dir")
            written += _save(score_vs_budget(by_tokens, f"Score vs KV budget: {model} on {data}"), out,
                             f"{stem}_score_vs_budget")
            written += _save(throughput_vs_budget(runs, f"Throughput vs KV budget: {model} on {data}"), out,
                             f"{stem}_throughput")
        written += _save(accuracy_vs_throughput(every_run, f"Accuracy vs throughput: {model} on {data}"), out,
                         f"{stem}_tradeoff")
        for budget, figure in needle_heatmaps(every_run, f"Needle score by depth and length: {model} on {data}"):
            written += _save(figure, out, f"{stem}_needles_{budget if budget.startswith('r') else 'b' + budget}")
    return written

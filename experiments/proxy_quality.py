"""How well do attention-free scores stand in for attention? (the PagedEviction paper's open Q2)

    .venv/bin/python experiments/proxy_quality.py                  # 6 prompts per task -> results/proxy_quality
    .venv/bin/python experiments/proxy_quality.py --limit 2 --out /tmp/proxy

For each prompt of the embedded suite (SmolLM2-135M, Hugging Face, float32, one forward pass over
the prompt), in every layer and KV head, the *truth* is the attention mass the observation window
(the prompt's last 32 queries, where the question sits) pays each earlier token: the signal SnapKV
and H2O evict by (``policies.attention.received_attention``). Each proxy scores the same tokens
with the policies' own functions: ||V||/||K|| (PagedEviction), -||K|| (inverse key norm), KeyDiff,
and recency (position, StreamingLLM's implicit score). Over the tokens the policies choose among
(after the first block of 32, which PagedEviction, Knorm and KeyDiff all keep, whose first token
is the attention sink, and before the window):

* spearman: rank correlation of proxy and truth;
* recall@10%: the share of the 10% most-attended tokens that the proxy's top 10% contains
  (0.10 for a random choice);
* mass@10%: the attention mass the proxy's top 10% keeps over the mass the best 10% keep.

Writes ``per_head.csv`` (prompt x proxy x layer x head), ``summary.csv`` / ``summary.md`` (each
metric averaged over layers and heads per prompt, then over prompts with a 95% bootstrap interval;
paired differences of ||V||/||K|| against each other proxy over the same prompts) and heatmaps
(layer x KV head) of each proxy's mean Spearman correlation and mass@10%.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.tasks import load_samples, task_spec  # noqa: E402
from harness.tasks.prompts import build_prompt  # noqa: E402
from harness.eviction.hf_reference import window_attention_implementation  # noqa: E402
from harness.config.models import resolve_model_path  # noqa: E402
from harness.analysis.stats import bootstrap  # noqa: E402
from policies.attention import Window, received_attention  # noqa: E402
from policies.keydiff import key_diff  # noqa: E402
from policies.knorm import inverse_key_norm  # noqa: E402
from policies.paged import value_key_ratio  # noqa: E402

WINDOW = 32
FIRST = 32  # the protected first block
TOP = 0.10
PROXIES = {
    "||V||/||K||": value_key_ratio,
    "-||K||": inverse_key_norm,
    "keydiff": key_diff,
    "recency": lambda keys, values: torch.arange(keys.shape[0], dtype=torch.float32).expand(keys.shape[1], -1),
}
METRICS = ("spearman", "recall", "mass")


def ranks(x: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.argsort(x, dim=-1), dim=-1).float()


def compare(proxy: torch.Tensor, truth: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head (rows): Spearman, recall@10% and mass@10% of ``proxy`` against ``truth``."""
    rp, rt = ranks(proxy), ranks(truth)
    rp, rt = rp - rp.mean(-1, keepdim=True), rt - rt.mean(-1, keepdim=True)
    spearman = (rp * rt).sum(-1) / (rp.norm(dim=-1) * rt.norm(dim=-1))
    k = max(1, round(TOP * truth.shape[-1]))
    chosen, best = proxy.topk(k, dim=-1).indices, truth.topk(k, dim=-1).indices
    hit = torch.zeros_like(truth, dtype=torch.bool).scatter_(-1, best, True).gather(-1, chosen)
    mass = truth.gather(-1, chosen).sum(-1) / truth.gather(-1, best).sum(-1)
    return {"spearman": spearman, "recall": hit.float().mean(-1), "mass": mass}


class Capture:
    """The last ``WINDOW`` queries of each layer, reported by the window attention implementation."""

    def __init__(self, model):
        self.queries: dict[int, torch.Tensor] = {}
        self.scales = [float(layer.self_attn.scaling) for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.kv_report_queries = self.report

    def report(self, layer: int, queries: torch.Tensor) -> None:
        self.queries[layer] = queries[-WINDOW:].detach()


@torch.no_grad()
def measure(model, capture: Capture, prompt: list[int]) -> list[dict]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows = []
    for layer, entry in enumerate(cache.layers):
        keys, values = entry.keys[0].transpose(0, 1), entry.values[0].transpose(0, 1)  # [tokens, heads, dim]
        truth = received_attention(Window(capture.queries[layer], capture.scales[layer]), keys)[:, FIRST:-WINDOW]
        for name, score in PROXIES.items():
            result = compare(score(keys, values)[:, FIRST:-WINDOW], truth)
            for head in range(truth.shape[0]):
                rows.append({"proxy": name, "layer": layer, "head": head,
                             **{m: float(result[m][head]) for m in METRICS}})
    return rows


def interval(values: np.ndarray) -> tuple[float, float, float]:
    """Mean and 95% bootstrap interval (the harness's seeded scheme, ``harness.analysis.stats``)."""
    draws = bootstrap({"all": values})["all"] / 100
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(np.mean(values)), float(low), float(high)


def summarize(per_head: pd.DataFrame) -> pd.DataFrame:
    per_prompt = per_head.groupby(["prompt", "proxy"])[list(METRICS)].mean().reset_index()
    rows = []
    for proxy in PROXIES:
        mine = per_prompt[per_prompt.proxy == proxy].set_index("prompt").sort_index()
        row = {"proxy": proxy, "prompts": len(mine)}
        for metric in METRICS:
            row[metric], row[f"{metric}_low"], row[f"{metric}_high"] = interval(mine[metric].to_numpy())
        rows.append(row)
    base = per_prompt[per_prompt.proxy == "||V||/||K||"].set_index("prompt").sort_index()
    for proxy in list(PROXIES)[1:]:
        other = per_prompt[per_prompt.proxy == proxy].set_index("prompt").sort_index()
        row = {"proxy": f"||V||/||K|| - {proxy}", "prompts": len(base)}
        for metric in METRICS:
            row[metric], row[f"{metric}_low"], row[f"{metric}_high"] = interval((base[metric] - other[metric]).to_numpy())
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(summary: pd.DataFrame, per_head: pd.DataFrame, command: str, seconds: float) -> str:
    def cell(row, metric):
        low, high = row[f"{metric}_low"], row[f"{metric}_high"]
        mark = "*" if row["proxy"].startswith("||V||/||K|| -") and (low > 0 or high < 0) else ""
        return f"{row[metric]:+.3f} ({low:+.3f}, {high:+.3f}){mark}"

    lines = [
        "# Attention-free scores as proxies for window attention (SmolLM2-135M, embedded suite)", "",
        f"`{command}` ({seconds / 60:.1f} min). Truth: the attention mass the prompt's last {WINDOW} queries pay "
        f"each token between the first block ({FIRST} tokens, always kept) and the window, per layer and KV head. Each metric is averaged over layers and KV heads per prompt, "
        f"then over {summary.prompts.iloc[0]} prompts (95% bootstrap interval over prompts; * = the paired "
        "difference excludes 0). recall@10% of a random choice is 0.10.", "",
        "| proxy | spearman | recall@10% | mass@10% |", "|---|---|---|---|",
    ]
    for _, row in summary.iterrows():
        lines.append(f"| {row['proxy']} | " + " | ".join(cell(row, m) for m in METRICS) + " |")
    best = per_head.groupby(["proxy", "layer", "head"])["spearman"].mean().reset_index()
    lines += ["", "Share of (layer, KV head) pairs where each proxy has the highest mean Spearman correlation:", ""]
    winners = best.loc[best.groupby(["layer", "head"])["spearman"].idxmax(), "proxy"].value_counts(normalize=True)
    lines += [f"- {proxy}: {share:.0%}" for proxy, share in winners.items()]
    return "\n".join(lines) + "\n"


def heatmaps(per_head: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = per_head.groupby(["proxy", "layer", "head"])[list(METRICS)].mean()
    for metric, (low, high), cmap in (("spearman", (-1, 1), "RdBu_r"), ("mass", (0, 1), "viridis")):
        fig, axes = plt.subplots(len(PROXIES), 1, figsize=(10, 1.2 + 1.1 * len(PROXIES)), sharex=True)
        for ax, proxy in zip(axes, PROXIES):
            grid = means.loc[proxy][metric].unstack("layer")
            image = ax.imshow(grid.to_numpy(), aspect="auto", cmap=cmap, vmin=low, vmax=high)
            ax.set_ylabel(f"{proxy}\nKV head", fontsize=8)
            ax.set_yticks(range(grid.shape[0]))
        axes[-1].set_xlabel("layer")
        fig.colorbar(image, ax=axes, label=f"mean {metric}" + (" @10%" if metric == "mass" else ""))
        fig.suptitle(f"{metric}: attention-free score vs window attention, per layer and KV head")
        for suffix in ("png", "pdf"):
            fig.savefig(out / f"heatmap_{metric}.{suffix}", dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=6, help="prompts per task of the embedded suite")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "proxy_quality")
    args = parser.parse_args(argv)
    from harness.config import DataSettings
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("embedded:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=window_attention_implementation("sdpa")).eval()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    capture = Capture(model)
    samples = load_samples(DataSettings("embedded", "embedded", limit=args.limit, seed=0))
    args.out.mkdir(parents=True, exist_ok=True)
    started, rows = time.perf_counter(), []
    for index, sample in enumerate(samples):
        prompt = build_prompt(sample, task_spec(sample.task), tokenizer, 7500).token_ids
        for row in measure(model, capture, prompt):
            rows.append({"prompt": index, "task": sample.task, "tokens": len(prompt), **row})
        print(f"[proxy] {index + 1}/{len(samples)} {sample.task} {len(prompt)} tokens "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    per_head = pd.DataFrame(rows)
    per_head.to_csv(args.out / "per_head.csv", index=False)
    summary = summarize(per_head)
    summary.to_csv(args.out / "summary.csv", index=False)
    command = "python experiments/proxy_quality.py" + (f" --limit {args.limit}" if args.limit != 6 else "")
    text = markdown(summary, per_head, command, time.perf_counter() - started)
    (args.out / "summary.md").write_text(text)
    heatmaps(per_head, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

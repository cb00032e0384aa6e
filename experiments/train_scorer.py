"""Train the learned eviction score (``policies/learned.py``) and measure it on held-out prompts.

    .venv/bin/python experiments/train_scorer.py             # writes policies/learned_scorer.json
    .venv/bin/python experiments/train_scorer.py --per-task 3 --out /tmp/scorer

Prompts: the embedded suite generated with seed 101 (every evaluation set here uses seed 0; the
script checks that no training prompt equals an evaluation prompt), ``--per-task`` of each task,
the first two thirds for training and the rest held out. Labels: for each prompt, layer and KV head
of SmolLM2-135M (Hugging Face, float32, one forward pass), the log of the attention mass the
prompt's last 32 queries pay each token between the protected first block and the window (the
proxy study's truth, ``experiments/proxy_quality.py``). Features: ``policies.learned.features``.
Fit: least squares over every (prompt, layer, head), features and labels centred per head (only the
order of tokens within a head matters to eviction). Reported: the held-out Spearman correlation
with the truth, per prompt averaged over layers and heads, of the learned score and of ||V||/||K||
with the same prompts, and their paired difference.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from harness.tasks import load_samples, task_spec  # noqa: E402
from harness.tasks.prompts import build_prompt  # noqa: E402
from harness.eviction.hf_reference import window_attention_implementation  # noqa: E402
from harness.config.models import resolve_model_path  # noqa: E402
from harness.analysis.stats import bootstrap  # noqa: E402
from policies.attention import Window, received_attention  # noqa: E402
from policies.learned import FEATURES, WEIGHTS, features  # noqa: E402
from policies.paged import value_key_ratio  # noqa: E402
from proxy_quality import FIRST, WINDOW, Capture, compare  # noqa: E402

TRAIN_SEED, EVALUATION_SEED = 101, 0


@torch.no_grad()
def head_rows(model, capture: Capture, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(features [tokens, 5], log attention mass [tokens], ||V||/||K|| [tokens]) per layer and head."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows = []
    for layer, entry in enumerate(cache.layers):
        keys, values = entry.keys[0].transpose(0, 1), entry.values[0].transpose(0, 1)
        truth = received_attention(Window(capture.queries[layer], capture.scales[layer]), keys)[:, FIRST:-WINDOW]
        feats = features(keys, values)[:, FIRST:-WINDOW]
        ratio = value_key_ratio(keys, values)[:, FIRST:-WINDOW]
        rows += [(feats[h], torch.log(truth[h] + 1e-6), ratio[h]) for h in range(truth.shape[0])]
    return rows


def centred(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=0, keepdim=True)


def fit(rows) -> torch.Tensor:
    x = torch.cat([centred(f) for f, _, _ in rows]).double()
    y = torch.cat([centred(t[:, None]) for _, t, _ in rows]).double()
    return torch.linalg.lstsq(x, y).solution[:, 0].float()


def spearman(score: torch.Tensor, truth: torch.Tensor) -> float:
    return float(compare(score[None], truth[None])["spearman"][0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-task", type=int, default=6, help="generated prompts per task")
    parser.add_argument("--out", type=Path, default=WEIGHTS, help="where the fitted weights go")
    args = parser.parse_args(argv)
    from harness.config import DataSettings
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("embedded:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=window_attention_implementation("sdpa")).eval()
    capture = Capture(model)
    training = load_samples(DataSettings("embedded", "embedded", limit=args.per_task, seed=TRAIN_SEED))
    evaluation = load_samples(DataSettings("embedded", "embedded", limit=None, seed=EVALUATION_SEED))
    overlap = {s.context for s in training} & {s.context for s in evaluation}
    if overlap:
        raise SystemExit(f"{len(overlap)} training context(s) also appear in the evaluation suite")
    started, prompts = time.perf_counter(), []
    for index, sample in enumerate(training):
        prompt = build_prompt(sample, task_spec(sample.task), tokenizer, 7500).token_ids
        prompts.append(head_rows(model, capture, prompt))
        print(f"[train] {index + 1}/{len(training)} {sample.task} {len(prompt)} tokens "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    # Every task in both parts: each task's first two thirds train, the rest is held out.
    by_task: dict[str, list[int]] = {}
    for index, sample in enumerate(training):
        by_task.setdefault(sample.task, []).append(index)
    held_out = {i for indices in by_task.values() for i in indices[(2 * len(indices)) // 3:]}
    weights = fit([row for i, rows in enumerate(prompts) if i not in held_out for row in rows])
    learned_rho, ratio_rho = [], []
    for i in sorted(held_out):
        learned_rho.append(np.mean([spearman(f @ weights, t) for f, t, _ in prompts[i]]))
        ratio_rho.append(np.mean([spearman(r, t) for _, t, r in prompts[i]]))
    difference = np.array(learned_rho) - np.array(ratio_rho)
    draws = bootstrap({"all": difference})["all"] / 100
    low, high = np.percentile(draws, [2.5, 97.5])
    command = "python experiments/train_scorer.py" + (f" --per-task {args.per_task}" if args.per_task != 6 else "")
    record = {
        "features": list(FEATURES),
        "weights": [round(float(w), 6) for w in weights],
        "command": command,
        "model": "smollm2-135m-instruct (Hugging Face, float32)",
        "training": f"embedded suite, seed {TRAIN_SEED}, {args.per_task} per task: {len(training) - len(held_out)} "
                    f"prompts trained, {len(held_out)} held out; evaluation sets use seed {EVALUATION_SEED}",
        "label": f"log attention mass from the prompt's last {WINDOW} queries, tokens {FIRST}..-{WINDOW}, per head",
        "held_out_spearman": {"learned": round(float(np.mean(learned_rho)), 4),
                              "value_key_ratio": round(float(np.mean(ratio_rho)), 4),
                              "learned_minus_ratio": [round(float(np.mean(difference)), 4),
                                                      round(float(low), 4), round(float(high), 4)]},
        "seconds": round(time.perf_counter() - started),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

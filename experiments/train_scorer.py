"""Train the learned eviction score (``policies/learned.py``) and measure it on held-out prompts.

    .venv/bin/python experiments/train_scorer.py             # writes policies/learned_scorer.json
    .venv/bin/python experiments/train_scorer.py --per-shape 3 --evaluation-per-task 1 --out /tmp/scorer.json

Prompts: text of its own (``experiments/scorer_text.py``, seed ``scorer_text.SEED``): five shapes
(village notes with a key-holder to find, numbered letters, a workshop diary with a serial number,
a storeroom account with a shelf list, a Python stock module to continue), ``--per-shape`` of each,
1.1k-7.5k tokens of SmolLM2 with its chat template (the code without it), from sentence templates
and word lists that no evaluation generator uses. Before any model loads, the script refuses to
train if one sentence of a training prompt (at least 4 words, normalised) or one training answer
occurs in any evaluation family's text (``scorer_text.require_disjoint``: the embedded suite at
every seed and size a committed config uses and 200 per task, RULER at its committed lengths and
8192, every family's templates; ``--longbench DIR`` adds local LongBench JSONL files), or if a
generator word occurs in evaluation text. Every third prompt of each shape is held out; the rest
train. Labels: for each prompt, layer and KV head of SmolLM2-135M (Hugging Face, float32, one
forward pass), the log of the attention mass the prompt's last 32 queries pay each token between
the protected first block and the window (the proxy study's truth, ``experiments/proxy_quality.py``).
Features: ``policies.learned.features``. Fit: least squares over every (prompt, layer, head),
features and labels centred per head (only the order of tokens within a head matters to eviction).
Reported: the Spearman correlation with the truth, per prompt averaged over layers and heads, of
the learned score and of ||V||/||K|| and their paired difference (95% bootstrap interval over
prompts), on the held-out prompts and, out of distribution, on the first ``--evaluation-per-task``
prompts of each task of the embedded suite at seed 0 (the prompts cpu_accuracy evaluates; measured
only, never trained on). The weights the output file held before are scored on the same prompts
and printed (not recorded).
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
import scorer_text  # noqa: E402

EVALUATION_SEED = 0


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


def correlations(prompts: list, weights: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: the learned score's and ||V||/||K||'s Spearman correlation with the truth,
    averaged over layers and heads."""
    learned = [np.mean([spearman(f @ weights, t) for f, t, _ in rows]) for rows in prompts]
    ratio = [np.mean([spearman(r, t) for _, t, r in rows]) for rows in prompts]
    return np.array(learned), np.array(ratio)


def summary(learned: np.ndarray, ratio: np.ndarray) -> dict:
    difference = learned - ratio
    draws = bootstrap({"all": difference})["all"] / 100
    low, high = np.percentile(draws, [2.5, 97.5])
    return {"prompts": len(learned), "learned": round(float(np.mean(learned)), 4),
            "value_key_ratio": round(float(np.mean(ratio)), 4),
            "learned_minus_ratio": [round(float(np.mean(difference)), 4), round(float(low), 4), round(float(high), 4)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-shape", type=int, default=scorer_text.PER_SHAPE, help="generated prompts per shape")
    parser.add_argument("--evaluation-per-task", type=int, default=4,
                        help="embedded-suite prompts (seed 0) per task the weights are measured on")
    parser.add_argument("--longbench", type=Path, default=None, help="a directory of LongBench JSONL files to check against")
    parser.add_argument("--out", type=Path, default=WEIGHTS, help="where the fitted weights go")
    args = parser.parse_args(argv)
    from harness.config import DataSettings
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("embedded:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    started = time.perf_counter()
    training = scorer_text.generate(per_shape=args.per_shape)
    _, corpora = scorer_text.require_disjoint(training, tokenizer, args.longbench)
    checked = {name: len(each.sentences) for name, each in corpora.items() if each.sentences}
    print(f"[check] no training sentence or answer in evaluation text: {len(scorer_text.training_corpus(training).sentences)} "
          f"training sentences against {checked} ({time.perf_counter() - started:.0f} s)", flush=True)
    evaluation = load_samples(DataSettings("embedded", "embedded", limit=args.evaluation_per_task, seed=EVALUATION_SEED))
    previous = None
    if args.out.is_file():
        fitted = json.loads(args.out.read_text())
        if tuple(fitted.get("features", ())) == FEATURES:
            previous = torch.tensor(fitted["weights"], dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=window_attention_implementation("sdpa")).eval()
    capture = Capture(model)
    prompts, measured = [], []
    for part, samples, rules, out in (("train", training, scorer_text.spec, prompts),
                                      ("evaluation", evaluation, task_spec, measured)):
        for index, sample in enumerate(samples):
            prompt = build_prompt(sample, rules(sample.task), tokenizer, 7500).token_ids
            out.append(head_rows(model, capture, prompt))
            print(f"[{part}] {index + 1}/{len(samples)} {sample.task} {len(prompt)} tokens "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    # Every shape in both parts: every third prompt of a shape (so each context size) is held out.
    held_out = {i for i, sample in enumerate(training) if int(sample.id.rsplit("-", 1)[1]) % 3 == 2}
    weights = fit([row for i, rows in enumerate(prompts) if i not in held_out for row in rows])
    held = [prompts[i] for i in sorted(held_out)]
    result = {"held_out_spearman": summary(*correlations(held, weights)),
              "evaluation_spearman": summary(*correlations(measured, weights))}
    if previous is not None:
        print("[previous weights] " + json.dumps({"weights": previous.tolist(),
                                                  "held_out": summary(*correlations(held, previous)),
                                                  "evaluation": summary(*correlations(measured, previous))}))
    command = "python experiments/train_scorer.py" + (f" --per-shape {args.per_shape}" if args.per_shape != scorer_text.PER_SHAPE else "") \
        + (f" --evaluation-per-task {args.evaluation_per_task}" if args.evaluation_per_task != 4 else "") \
        + (f" --longbench {args.longbench}" if args.longbench else "")
    record = {
        "features": list(FEATURES),
        "weights": [round(float(w), 6) for w in weights],
        "command": command,
        "model": "smollm2-135m-instruct (Hugging Face, float32)",
        "training": f"experiments/scorer_text.py, seed {scorer_text.SEED}, {args.per_shape} per shape of "
                    f"{len(scorer_text.SHAPES)} ({', '.join(scorer_text.SHAPES)}): {len(training) - len(held_out)} "
                    f"prompts trained, {len(held_out)} held out; no sentence (4+ words) or answer in any "
                    f"evaluation text ({', '.join(f'{n}: {c} sentences' for n, c in checked.items())})",
        "evaluation": f"embedded suite, seed {EVALUATION_SEED}, first {args.evaluation_per_task} per task "
                      f"({len(evaluation)} prompts), measured only",
        "label": f"log attention mass from the prompt's last {WINDOW} queries, tokens {FIRST}..-{WINDOW}, per head",
        **result,
        "seconds": round(time.perf_counter() - started),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

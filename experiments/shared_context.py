"""One context, many questions: each asked as its own request over one cached context (SCBench's
shared-context, multi-request workloads; KVzip's setting), in the real engine with prefix caching.

    flock /tmp/engine.lock .venv/bin/python experiments/shared_context.py [--contexts 8] [--questions 6] [--ratio 0.5]
        [--kv-cache-gib 4] [--out results/shared_context] [--configs "kvzip context"] [--layer-groups 3]

The workload (``harness.serving.workloads.shared_contexts``, the serving benchmark's one definition, from the embedded suite's vocabulary):
half the contexts a long text hiding one access code per person (key_retrieval's needle, several
of them), half passages about people, each born somewhere (multi_doc_qa's); every context is
asked ``QUESTIONS`` questions, one per person, with the suite's own templates and scoring. All
requests go to one engine at once, as a server would take them; between configurations the
prefix cache is emptied, so each starts cold and caches each context as its first request computes it.

Configurations, at one compression ratio (of what each compresses):

* ``full``: full cache; the context's blocks are shared by every question of it (prefix caching).
* ``context``: query-agnostic (``compress=context``), PagedEviction, StreamingLLM, KeyDiff,
  SnapKV and KVzip: the context is compressed before any question is seen, once, by its first
  request, and every later question takes that compressed context (``harness.engine.shared_contexts``).
  KVzip (issue 50) scores the context by having the model repeat it (its reconstruction passes, run
  once, by the compressing request); each request carries its prompt's reconstruction ids as the
  prompt builder makes them for ``run.py`` (``harness.tasks.prompts.reconstruction``, through
  ``build_prompt``), and the summary reports the passes' cost (the ledger's ``reconstruct_tokens``
  and ``reconstruct_s``).
* ``context unshared``: PagedEviction the same way with ``share_context=false``: each request
  compresses the context again and holds its own copy (how every compressing configuration ran
  before contexts were shared), measured beside the shared one.
* ``prompt``: query-aware, each request compresses context and its own question together.
* ``first question``: query-aware for the first question only, the cache then reused for the
  others (SCBench's multi-request failure mode): the later questions' requests compress context +
  the first question (the boundary is put after it) and get their own question on top.

``prompt`` cannot share: what each request keeps depends on its own question, so each holds its own
copy. ``first question``'s later requests all compress the same tokens (the context and the first
question), so they share one compressed copy like ``context``.

``--layer-groups G`` (G > 1) runs the engine's attention layers as G KV cache groups
(``engine.layer_groups``) and adds ``kvzip context schedule=kvzip``: KVzip compressing the context
with its own allocation across the groups (``budget_schedule=kvzip``: each group's budget from the
one threshold over every layer's and head's reconstruction scores, docs/policies.md) beside
``kvzip context``, whose groups each keep the same count per layer and KV head (pair-uniform, the
engine's default). A measured schedule's budgets are the request's own, so its requests share no
compressed context (``harness.eviction.settings``, ``unshareable``): each compresses its own copy,
the context's passes run once all the same (the worker keeps recent contexts' scores).

Per configuration: accuracy on the first question and on the later ones (95% intervals over
whole contexts, ``harness.analysis.stats.cell_interval``; paired differences with whole contexts
flipped together, ``harness.analysis.clustered``), the KV blocks in use (peak and mean over steps, from the scheduler's
ledger), the prefill evictions run and the requests that took a shared context, the requests' wall
time and output tokens per second. Writes ``results/shared_context/``:
``summary.md``, ``summary.csv``, ``comparisons.csv``, ``requests.jsonl``, ``shared_context.png``,
``provenance.json`` (the code of each engine run and of the statistics);
``--reanalyse`` rewrites the statistics from a committed ``requests.jsonl`` with no engine.

``--configs`` runs only the named configurations (comma-separated, as the summary names them:
``--configs "kvzip context"``), always with full cache beside them as the comparison. Where
``--out`` already holds a run with the same workload and settings (the same command but for
``--configs``), the new configurations join it: the earlier run's configurations, full cache
included, are kept as they were, the new ones added (or replacing an earlier run of the same
name), and the full cache run beside them is checked against the kept one (how many answers are
the same text; ``added.json`` records it with the command, and the summary says it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.serving.workloads import QUESTIONS, WORDS, Shared, footer_tokens, prompts_of, shared_contexts  # noqa: E402,F401

OUT = ROOT / "results" / "shared_context"
POLICIES = ("paged", "snapkv")          # every mode
MODES = ("context", "prompt", "first question")
CONTEXT_ONLY = ("streaming", "keydiff", "kvzip")  # the context mode alone
UNSHARED = "context unshared"            # PagedEviction's context mode with share_context=false
SCHEDULED = "context schedule=kvzip"     # KVzip's context mode with its global threshold over layer groups
SCHEDULED_NAME = f"kvzip {SCHEDULED}"    # its configuration's name (name_of)
# Compared beside each one's difference from full cache: KVzip against PagedEviction, both compressing the context.
EXTRA_PAIRS = (("kvzip context", "paged context"), (SCHEDULED_NAME, "kvzip context"))
ADDED = "added.json"                     # configurations a later --configs run added to a directory's run


def configurations(context_only: bool = False, layer_groups: int = 1) -> list[tuple[str, str | None]]:
    """(mode, policy) in the order they run and print (``context_only``: full cache and the
    context modes alone; KVzip's schedule across layer groups where there are groups)."""
    modes = ("context",) if context_only else MODES
    return ([("full", None)] + [(mode, policy) for policy in POLICIES for mode in modes]
            + [("context", policy) for policy in CONTEXT_ONLY] + [(UNSHARED, "paged")]
            + ([(SCHEDULED, "kvzip")] if layer_groups > 1 else []))


def name_of(configuration: tuple[str, str | None]) -> str:
    """The configuration's name in the summary: ``full``, or ``<policy> <mode>``."""
    mode, policy = configuration
    return "full" if mode == "full" else f"{policy} {mode}"


def selected(context_only: bool = False, configs: str | None = None,
             layer_groups: int = 1) -> dict[str, tuple[str, str | None]]:
    """name -> (mode, policy), in run order: every configuration (``configurations``), or full cache
    and those ``configs`` names (comma-separated summary names; full cache always runs, the comparison)."""
    named = {name_of(c): c for c in configurations(context_only, layer_groups)}
    if configs is None:
        return named
    wanted = [name.strip() for name in configs.split(",") if name.strip()]
    if SCHEDULED_NAME in wanted and layer_groups < 2:
        raise ValueError(f"--configs {SCHEDULED_NAME!r} needs --layer-groups 2 or more: with the layers as one "
                         "KV cache group there is no allocation across groups to measure")
    unknown = [name for name in wanted if name not in named]
    if unknown or not wanted:
        raise ValueError(f"--configs: {', '.join(map(repr, unknown)) or 'nothing named'}; the configurations "
                         f"are: {', '.join(named)}")
    return {name: c for name, c in named.items() if name == "full" or name in wanted}


def reconstructs(policy: str | None) -> bool:
    """Whether ``policy`` scores by reconstructing the context (KVzip): its requests carry
    reconstruction ids (every other policy refuses them)."""
    from policies import REGISTRY

    entry = REGISTRY.get(policy) if policy else None
    return entry is not None and entry.reconstructs


def workload(contexts: int, seed: int = 0, questions: int = QUESTIONS) -> list[Shared]:
    """The contexts and their questions: one definition, the serving benchmark's
    (``harness.serving.workloads.shared_contexts``)."""
    return shared_contexts(contexts, seed, questions)


@dataclass(frozen=True)
class Request:
    shared: Shared
    question: int
    token_ids: list[int]
    settings: dict           # SamplingParams.extra_args["kv_eviction"]


def after_first_question(first, later, footer: int) -> tuple[list[int], int]:
    """The tokens of ``later``'s request when the cache was compressed for the first question: the
    context and the first question (without the chat template's closing ``footer`` tokens), the
    boundary after them, then the later question's own part."""
    question_one = first.token_ids[first.context_tokens:len(first.token_ids) - footer]
    tokens = first.token_ids[:first.context_tokens] + question_one + later.token_ids[later.context_tokens:]
    return tokens, first.context_tokens + len(question_one)


def requests_for(configuration: tuple[str, str | None], workload_prompts, ratio: float, tokenizer) -> list[Request]:
    mode, policy = configuration
    made = []
    for shared, prompts in workload_prompts:
        footer = footer_tokens(tokenizer, prompts)
        for q, prompt in enumerate(prompts):
            tokens, boundary = prompt.token_ids, prompt.context_tokens
            if mode == "full":
                settings = {"policy": "full"}
            else:
                settings = {"policy": policy, "budget_ratio": ratio, "decode_eviction": False}
                if mode == "first question" and q > 0:
                    tokens, boundary = after_first_question(prompts[0], prompt, footer)
                if mode in ("context", UNSHARED, SCHEDULED) or (mode == "first question" and q > 0):
                    settings.update(compress="context", context_tokens=boundary)
                if mode == UNSHARED:
                    settings.update(share_context=False)
                if mode == SCHEDULED:
                    settings.update(budget_schedule="kvzip")
                if reconstructs(policy):
                    # the prompt builder's ids, as run.py's requests carry them (CellWork.eviction_for)
                    if prompt.reconstruction is None:
                        raise RuntimeError(f"{shared.id}: the prompt builder found no chat header to reconstruct "
                                           f"question {q}'s context from")
                    settings.update(reconstruction=prompt.reconstruction)
            made.append(Request(shared, q, list(tokens), settings))
    return made


ARRIVALS = ("together", "rounds")


def arrival_rounds(requests: list[Request], arrivals: str) -> list[list[int]]:
    """The requests' indices in the batches they arrive in: all at once (``together``), or one
    question of every context per round, each round sent when the one before has finished
    (``rounds``: a context's later questions come after its first has been answered, so they find
    its compressed context kept but held by no running request)."""
    if arrivals == "together":
        return [list(range(len(requests)))]
    rounds: dict[int, list[int]] = {}
    for index, request in enumerate(requests):
        rounds.setdefault(request.question, []).append(index)
    return [rounds[question] for question in sorted(rounds)]


def run_configuration(engine, requests: list[Request], arrivals: str = "together") -> tuple[list, float, dict]:
    from harness.eviction.settings import CONFIG_KEY
    from harness.tasks import task_spec

    engine.llm.reset_prefix_cache()  # every configuration starts cold
    engine.ledger(reset=True)
    specs = [task_spec(r.shared.task) for r in requests]
    results = [None] * len(requests)
    started = time.perf_counter()
    for batch in arrival_rounds(requests, arrivals):
        done = engine.generate([requests[i].token_ids for i in batch], [specs[i].max_new_tokens for i in batch],
                               [tuple(specs[i].stop) for i in batch],
                               settings=[{CONFIG_KEY: requests[i].settings} for i in batch], top_logprobs=0, progress=False)
        for index, result in zip(batch, done):
            results[index] = result
    return results, time.perf_counter() - started, engine.ledger()


def trial_orders(names: list[str], trials: int) -> list[list[str]]:
    """Each trial's order of the configurations: the listed order in odd trials, reversed in even
    ones (``harness.bench.throughput.run_order``'s rule), so over an even number of trials every
    configuration has the same mean position and a machine slowing down through the run is not
    charged to whichever configuration runs last."""
    return [names[::-1] if trial % 2 else list(names) for trial in range(trials)]


def throughput_table(trials: list[dict]) -> list[dict]:
    """Per configuration, over the trials (``trials``: one entry per configuration and trial with
    its position in the run and output tok/s): tok/s per trial, the ratio to full cache of the same
    trial as a geometric mean with a 95% t-interval over trials (``ratio_interval``), the same ratio
    from a fit with a straight time trend in run position (``trend_ratios``), the requests running at
    once at the peak and the preemptions."""
    from harness.analysis.stats import ratio_interval, trend_ratios

    names = list(dict.fromkeys(t["configuration"] for t in trials))
    by = {(t["configuration"], t["trial"]): t for t in trials}
    numbers = sorted({t["trial"] for t in trials})
    trend = trend_ratios([t["output_tok_s"] for t in trials], [t["configuration"] for t in trials],
                         [t["position"] for t in trials], "full")
    table = []
    for name in names:
        mine = [by[name, n] for n in numbers]
        line = {"configuration": name, "tok_s": [t["output_tok_s"] for t in mine],
                "running_peak": max(t["running_peak"] for t in mine), "preemptions": mine[0]["preemptions"],
                "same_outputs": all(t["outputs_digest"] == mine[0]["outputs_digest"] for t in mine)}
        if name != "full":
            interval = ratio_interval([by[name, n]["output_tok_s"] / by["full", n]["output_tok_s"] for n in numbers])
            line.update(ratio=interval.estimate, ratio_low=interval.low, ratio_high=interval.high)
            if trend is not None:
                fitted = trend["ratios"][name]
                line.update(trend_ratio=fitted.estimate, trend_low=fitted.low, trend_high=fitted.high)
        table.append(line)
    return table


def throughput_markdown(table: list[dict], trials: list[dict], pool: int) -> list[str]:
    numbers = sorted({t["trial"] for t in trials})
    orders = [" > ".join(t["configuration"] for t in sorted((t for t in trials if t["trial"] == n),
                                                           key=lambda t: t["position"])) for n in numbers]
    lines = ["", f"## Throughput at a pool of {pool} blocks", "",
             f"{len(numbers)} trials on one engine, each running every configuration's requests once, in the "
             "listed order in odd trials and reversed in even ones (" + "; ".join(
                 f"trial {n}: {order}" for n, order in zip(numbers, orders)) + "). Ratio: output tokens per "
             "second over full cache's in the same trial, geometric mean with a 95% t-interval over trials; "
             "trend-fitted: the same ratio from log tok/s fitted as one level per configuration plus a straight "
             "line in run position (`harness.analysis.stats.trend_ratios`). Running at peak: the most requests "
             "the scheduler ran at once (the ledger's `running_requests_peak`). Same outputs: every trial "
             "generated the same tokens for every request.", "",
             "| configuration | output tok/s per trial | vs full (95%) | trend-fitted vs full (95%) | running at peak | "
             "preemptions | same outputs |", "|---|---|---|---|---|---|---|"]
    for line in table:
        ratio = (f"{line['ratio']:.2f}x ({line['ratio_low']:.2f}-{line['ratio_high']:.2f})"
                 if "ratio" in line else "1.00x")
        trend = (f"{line['trend_ratio']:.2f}x ({line['trend_low']:.2f}-{line['trend_high']:.2f})"
                 if "trend_ratio" in line else ("1.00x" if line["configuration"] == "full" else "-"))
        lines.append(f"| {line['configuration']} | {', '.join(f'{v:.1f}' for v in line['tok_s'])} | {ratio} | "
                     f"{trend} | {line['running_peak']} | {line['preemptions']} | "
                     f"{'yes' if line['same_outputs'] else 'no'} |")
    return lines


def summarize(rows: list[dict], runs: dict) -> list[dict]:
    import numpy as np

    from harness.analysis.stats import cell_interval

    table = []
    for name, (wall, ledger) in runs.items():
        mine = [row for row in rows if row["configuration"] == name]
        line = {"configuration": name, "requests": len(mine), "wall_s": round(wall, 2),
                "output_tokens_per_s": round(sum(r["output_tokens"] for r in mine) / wall, 2),
                "kv_blocks_peak": ledger["kv_blocks_used_peak"], "kv_blocks_mean": round(ledger["kv_blocks_used_mean"], 1),
                "prefill_evictions": ledger["evictions"]["prefill"], "evicted_tokens": ledger["evicted_tokens"],
                "shared_hits": (ledger.get("shared_contexts") or {}).get("hits", 0)}
        if ledger.get("reconstruct_tokens"):
            # KVzip's passes (only where they ran, so other summaries keep their columns), inside the
            # worker's eviction time evict_s
            line.update(reconstruct_tokens=int(ledger["reconstruct_tokens"]),
                        reconstruct_s=round(float(ledger["reconstruct_s"]), 3),
                        evict_s=round(float(ledger.get("evict_s", 0.0)), 3))
        for part, keep in (("first", lambda r: r["question"] == 0), ("later", lambda r: r["question"] > 0)):
            per_task = {}
            for row in mine:
                if keep(row):
                    per_task.setdefault(row["task"], []).append(row["score"])
            labels = {}  # each question's context: a context's questions are resampled together
            for row in mine:
                if keep(row):
                    labels.setdefault(row["task"], []).append(row["context"])
            interval = cell_interval({task: np.array(scores) for task, scores in per_task.items()},
                                     clusters={task: np.array(names) for task, names in labels.items()},
                                     bounds=(0.0, 1.0))  # the suite's scores lie in [0, 1]
            line.update({f"{part}": interval.estimate, f"{part}_low": interval.low, f"{part}_high": interval.high,
                         f"{part}_samples": interval.samples})
        table.append(line)
    shared = [row["prediction"] for row in rows if row["configuration"] == "paged context"]
    unshared = [row["prediction"] for row in rows if row["configuration"] == f"paged {UNSHARED}"]
    for line in table:
        if line["configuration"] == f"paged {UNSHARED}" and shared:
            # the same requests, computing their own compressed context: the same answers, or sharing broke something
            line["same_as_shared"] = sum(a == b for a, b in zip(shared, unshared))
    return table


def comparisons(rows: list[dict]) -> dict[str, list[dict]]:
    """The paired differences, whole contexts flipped together (``harness.analysis.clustered``): per
    part (first question, later questions), every compressing configuration minus full cache and,
    per policy, its modes against each other."""
    from harness.analysis.clustered import compare

    present = {row["configuration"] for row in rows}
    names = ([f"{policy} {mode}" for policy in POLICIES for mode in MODES] + [f"{p} context" for p in CONTEXT_ONLY]
             + [SCHEDULED_NAME])
    pairs = [(name, "full") for name in names]
    for policy in POLICIES:
        pairs += [(f"{policy} context", f"{policy} prompt"), (f"{policy} first question", f"{policy} prompt"),
                  (f"{policy} context", f"{policy} first question")]
    pairs += list(EXTRA_PAIRS)
    pairs = [pair for pair in pairs if set(pair) <= present]
    # On first questions the "first question" configuration is the prompt one (the same requests): left out there.
    first = [pair for pair in pairs if not any(name.endswith("first question") for name in pair)]
    return {"First question": compare(rows, first, lambda r: r["question"] == 0),
            "Later questions": compare(rows, pairs, lambda r: r["question"] > 0)}


def dead_questions(rows: list[dict]) -> tuple[int, int]:
    """How many questions score 0 in every configuration, of how many (a question no configuration
    answers tells nothing about the configurations' differences)."""
    scores: dict[tuple, list[float]] = {}
    for row in rows:
        scores.setdefault((row["context"], row["question"]), []).append(row["score"])
    return sum(not any(values) for values in scores.values()), len(scores)


def markdown(table: list[dict], command: str, contexts: int, ratio: float, model: str, pool: int,
             families: dict[str, list[dict]] | None = None, questions: int = QUESTIONS,
             arrivals: str = "together", dead: tuple[int, int] | None = None,
             trials: list[dict] | None = None, added: list[dict] | None = None, code: str | None = None,
             layer_groups: int = 1) -> str:
    """``code``: ``code_line``'s sentence naming the code the figures come from."""
    full = next(line for line in table if line["configuration"] == "full")
    lines = [
        "# One context, many questions", "",
        f"Command: `{command}`", "", *([code, ""] if code else []),
        f"{contexts} contexts (half access codes in a long text, half passages about people; about 2,000 tokens "
        f"each) x {questions} questions, each question its own request, all {contexts * questions} requests of a "
        + ("configuration sent at once" if arrivals == "together" else
           f"configuration sent in {questions} rounds (one question of every context per round, each round once the "
           "one before has finished)")
        + f" to one engine ({model}, prefix caching on, a pool of {pool} blocks of 32 "
        f"tokens, the prefix cache emptied between configurations"
        + (f"; its attention layers as {layer_groups} KV cache groups, `engine.layer_groups`, a block holding one "
           "group's layers" if layer_groups > 1 else "")
        + f"). Compression ratio {ratio:g} of what each "
        "configuration compresses. Accuracy: the suite's scores (0-100), mean over the two tasks of the task "
        "means, 95% intervals over whole contexts (a context's questions are not independent: the values m "
        "that a one-sample sign-flip test negating whole contexts' deviations from m does not reject, "
        "`harness.analysis.stats.cell_interval`); "
        "*first*: the first question of each context, *later*: the other "
        f"{questions - 1}. KV blocks: blocks in use over the configuration's engine steps (the scheduler's ledger; "
        "a block the prefix cache, or the compressed-context cache, holds for no running request is free). "
        "Evictions: prefill evictions run" + (f" (one per KV cache group: {layer_groups} per context compressed)"
                                              if layer_groups > 1 else "") + "; shared: requests that took a context another request compressed."
        + (f" Dead questions: {dead[0]} of the {dead[1]} questions score 0 in every configuration." if dead else ""), "",
        "| configuration | first question | later questions | KV blocks peak | KV blocks mean | peak vs full | "
        "mean vs full | evictions | shared | output tok/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for line in table:
        lines.append(
            f"| {line['configuration']} | {line['first']:.1f} ({line['first_low']:.1f}, {line['first_high']:.1f}) | "
            f"{line['later']:.1f} ({line['later_low']:.1f}, {line['later_high']:.1f}) | {line['kv_blocks_peak']} | "
            f"{line['kv_blocks_mean']:.1f} | {line['kv_blocks_peak'] / full['kv_blocks_peak']:.2f} | "
            f"{line['kv_blocks_mean'] / full['kv_blocks_mean']:.2f} | {line['prefill_evictions']} | "
            f"{line.get('shared_hits', 0)} | {line['output_tokens_per_s']:.1f} | {line['wall_s']:.1f} |")
    full_pool = [line["configuration"] for line in table if line["kv_blocks_peak"] >= 0.99 * pool]
    if full_pool:
        lines += ["", f"The pool was full in {', '.join(full_pool)}: requests waited for blocks there, and the "
                  "peak is the pool's size, not what the configuration asks for" + (
                      "." if "--pool-blocks" in command else " (rerun with a larger `--kv-cache-gib`).")]
    lines += ["", "Full cache's questions share one copy of each context through vLLM's prefix cache. A context "
              "compressed before its questions (`context`; and `first question`'s later requests, which compress "
              "the context with the first question) is compressed once, by the first request about it, and kept; "
              "the others take it (`harness.engine.shared_contexts`). A query-aware request (`prompt`) keeps what "
              "its own question attends to, so it holds its own copy, as `context unshared` does by setting. "
              + ("Wall time and tok/s in this table are the first trial's; every trial's are below."
                 if trials else "Timings are one run each on the 2-core CPU machine."), ""]
    unshared = next((line for line in table if line.get("same_as_shared") is not None), None)
    if unshared is not None:
        lines[-1:-1] = [f"`{unshared['configuration']}` asks the requests of `paged context`, each compressing its "
                        f"own copy: {unshared['same_as_shared']} of its {unshared['requests']} answers are the same "
                        "text as with the context shared.", ""]
    if any(line["configuration"] == SCHEDULED_NAME for line in table):
        lines[-1:-1] = [f"`{SCHEDULED_NAME}` compresses each context as `kvzip context` does, at the same ratio, with "
                        "each group's budget from KVzip's one threshold over every layer's and KV head's reconstruction "
                        "scores (`budget_schedule=kvzip`, kvpress's default allocation at group granularity) where "
                        "`kvzip context` keeps the same count in every layer and KV head (pair-uniform). Its budgets "
                        "are measured per request, so its requests share no compressed context: each holds its own copy.",
                        ""]
    lines += reconstruction_lines(table, layer_groups) + [line for entry in added or [] for line in (added_line(entry), "")]
    if families:
        from harness.analysis.clustered import section

        lines += section(families, f"one generated context: its {questions} questions' requests ({contexts} contexts, "
                         f"{contexts // 2} per task; on first questions every cluster holds one sample)")
    if trials:
        lines += throughput_markdown(throughput_table(trials), trials, pool)
    return "\n".join(lines)


def reconstruction_lines(table: list[dict], layer_groups: int = 1) -> list[str]:
    """What each reconstructing configuration's passes cost (the ledger's ``reconstruct_tokens`` and
    ``reconstruct_s``, which its eviction time ``evict_s`` includes), per compressed context too (the
    ledger counts a prefill eviction per KV cache group: one context compressed is ``layer_groups``)."""
    lines = []
    for line in table:
        tokens = number(line.get("reconstruct_tokens"))
        if not tokens:
            continue
        seconds, evict = number(line.get("reconstruct_s")), number(line.get("evict_s"))
        evictions = line["prefill_evictions"] / layer_groups
        lines += [f"`{line['configuration']}` reconstructed its contexts with {tokens:,.0f} tokens of passes in "
                  f"{seconds:.1f} s (the ledger's `reconstruct_tokens` and `reconstruct_s`; "
                  + (f"{tokens / evictions:,.0f} tokens and {seconds / evictions:.2f} s per compressed context, "
                     if evictions else "")
                  + f"{seconds / line['wall_s']:.0%} of its wall time; its eviction time `evict_s`, passes "
                  f"included, {evict:.1f} s). A request taking a shared compressed context runs no passes.", ""]
    return lines


def number(value) -> float:
    """A figure from ``summary.csv`` (pandas reads a column a line lacks as NaN): 0 where absent."""
    import math

    return 0.0 if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def added_line(entry: dict) -> str:
    """A configuration a later ``--configs`` run added to this directory's run, and how its full
    cache compares with the one kept here."""
    names = ", ".join(f"`{name}`" for name in entry["configurations"])
    return (f"Added by `{entry['command']}` (another engine, later): {names}. Full cache ran beside "
            f"{'it' if len(entry['configurations']) == 1 else 'them'} as the comparison and is not in the table: "
            f"{entry['full_same']} of its {entry['full_requests']} answers are the same text as the full cache above "
            f"(peak {entry['full_kv_blocks_peak']} blocks, mean {entry['full_kv_blocks_mean']:.1f}, "
            f"{entry['full_output_tokens_per_s']:.1f} output tok/s, {entry['full_wall_s']:.1f} s wall); the table's "
            "comparisons with full cache use the one above.")


def merge(previous_rows: list[dict], previous_table: list[dict], rows: list[dict], table: list[dict],
          order: list[str]) -> tuple[list[dict], list[dict], dict]:
    """An earlier run's rows and summary lines with a ``--configs`` run's: the earlier run's full cache
    and other configurations kept, the new run's other configurations added (replacing an earlier
    one of the same name), lines in ``order``; and how the new full cache compares with the kept one."""
    new = {line["configuration"] for line in table} - {"full"}
    kept_rows = [row for row in previous_rows if row["configuration"] not in new]
    merged_rows = kept_rows + [row for row in rows if row["configuration"] in new]
    by_name = {line["configuration"]: line for line in previous_table if line["configuration"] not in new}
    by_name.update({line["configuration"]: line for line in table if line["configuration"] in new})
    unknown = [name for name in by_name if name not in order]
    merged_table = [by_name[name] for name in order if name in by_name] + [by_name[name] for name in unknown]
    answer = lambda row: (row["context"], row["question"])
    old_full = {answer(row): row["prediction"] for row in previous_rows if row["configuration"] == "full"}
    new_full = [row for row in rows if row["configuration"] == "full"]
    if not old_full or set(old_full) != {answer(row) for row in new_full}:
        raise ValueError("the earlier run's full cache did not ask the same questions: not the same workload")
    full = next(line for line in table if line["configuration"] == "full")
    check = {"full_same": sum(old_full[answer(row)] == row["prediction"] for row in new_full),
             "full_requests": len(new_full), "full_kv_blocks_peak": full["kv_blocks_peak"],
             "full_kv_blocks_mean": full["kv_blocks_mean"], "full_wall_s": full["wall_s"],
             "full_output_tokens_per_s": full["output_tokens_per_s"], "configurations": sorted(new, key=order.index)}
    return merged_rows, merged_table, check


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [line["configuration"] for line in table]
    x = range(len(names))
    figure, (accuracy, memory) = plt.subplots(1, 2, figsize=(12, 4.2))
    for offset, part in ((-0.2, "first"), (0.2, "later")):
        values = [line[part] for line in table]
        errors = [[v - line[f"{part}_low"] for v, line in zip(values, table)],
                  [line[f"{part}_high"] - v for v, line in zip(values, table)]]
        accuracy.bar([i + offset for i in x], values, 0.4, yerr=errors, capsize=3, label=f"{part} question")
    accuracy.set_xticks(list(x), names, rotation=30, ha="right")
    accuracy.set_ylabel("score (0-100), 95% over contexts")
    accuracy.legend()
    for offset, key in ((-0.2, "peak"), (0.2, "mean")):
        memory.bar([i + offset for i in x], [line[f"kv_blocks_{key}"] for line in table], 0.4, label=key)
    memory.set_xticks(list(x), names, rotation=30, ha="right")
    memory.set_ylabel("KV blocks in use")
    memory.legend()
    figure.suptitle("One context, many questions")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_comparisons(families: dict[str, list[dict]], out: Path) -> None:
    """``comparisons.csv``: every paired difference of ``comparisons``, one row each, with its part."""
    import pandas as pd

    frame = pd.DataFrame([dict(part=part, **entry) for part, table in families.items() for entry in table])
    frame.to_csv(out / "comparisons.csv", index=False)


def runs_of(previous: list[dict]) -> dict[str, tuple[float, dict]]:
    """Each configuration's wall time and the ledger figures ``summarize`` reads, from ``summary.csv``'s
    lines (``Earlier.table``); the reconstruction figures where a line has them."""
    runs = {}
    for line in previous:
        ledger = {"kv_blocks_used_peak": int(line["kv_blocks_peak"]), "kv_blocks_used_mean": float(line["kv_blocks_mean"]),
                  "evictions": {"prefill": int(line["prefill_evictions"])}, "evicted_tokens": int(line["evicted_tokens"]),
                  "shared_contexts": {"hits": int(line.get("shared_hits", 0))},
                  "reconstruct_tokens": number(line.get("reconstruct_tokens")),
                  "reconstruct_s": number(line.get("reconstruct_s")), "evict_s": number(line.get("evict_s"))}
        runs[line["configuration"]] = (float(line["wall_s"]), ledger)
    return runs


@dataclass(frozen=True)
class Earlier:
    """What a run left in a directory: its command, model, pool, ratio and layer groups (``summary.md``), its rows
    (``requests.jsonl``), its summary lines (``summary.csv``; a column a line lacks is absent from
    it, not NaN) and the configurations added to it since (``added.json``)."""

    command: str
    model: str
    pool: int
    ratio: float
    layer_groups: int        # the command's --layer-groups (1 where it gives none)
    rows: list[dict]
    table: list[dict]
    added: list[dict]


def previous_run(out: Path) -> Earlier | None:
    """``out``'s run (``Earlier``); None where it holds none."""
    import re

    import pandas as pd

    if not all((out / name).exists() for name in ("requests.jsonl", "summary.csv", "summary.md")):
        return None
    text = (out / "summary.md").read_text()
    found = (re.search(r"Command: `([^`]*)`", text), re.search(r"one engine \(([^,]+), prefix caching on, a pool of (\d+) ", text),
             re.search(r"Compression ratio ([\d.]+)", text))
    if not all(found):
        raise SystemExit(f"{out}/summary.md: no command, model, pool or ratio to keep")
    table = [{key: value for key, value in line.items() if not (isinstance(value, float) and value != value)}
             for line in pd.read_csv(out / "summary.csv").to_dict("records")]
    groups = re.search(r"--layer-groups (\d+)", found[0].group(1))
    return Earlier(found[0].group(1), found[1].group(1), int(found[1].group(2)), float(found[2].group(1)),
                   int(groups.group(1)) if groups else 1,
                   [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()], table,
                   json.loads((out / ADDED).read_text()) if (out / ADDED).exists() else [])


PROVENANCE = "provenance.json"  # which code ran the engine (each run joined into the study) and the statistics


def record_code(out: Path, engine_run: str | None) -> str:
    """Record in ``out/provenance.json`` the code this process loaded as the statistics' (and, with
    ``engine_run``, the command just run on the engine, as one more engine run); the sentence the
    summary prints from it."""
    from harness.records.provenance import LOADED

    path = out / PROVENANCE
    recorded = json.loads(path.read_text()) if path.exists() else {"engine_runs": []}
    if engine_run is not None:
        recorded["engine_runs"].append({"command": engine_run, **LOADED})
    recorded["statistics"] = dict(LOADED)
    path.write_text(json.dumps(recorded, indent=1) + "\n")
    runs = "; ".join(f"`{run['command']}` at commit {run['git_commit']} (code version {run['code_version']})"
                     + (f", {run['recorded']}" if run.get("recorded") else "") for run in recorded["engine_runs"])
    return ("Code: " + (f"the engine ran {runs}" if runs else "the engine run's code version was not recorded")
            + f"; the statistics were computed at commit {LOADED['git_commit']} (code version {LOADED['code_version']}).")


def reanalyse(out: Path) -> int:
    """The statistics again from what the engine run left (``requests.jsonl``; the timings, KV counts,
    model and pool in ``summary.csv`` and ``summary.md``), no engine and no model: summary.md,
    summary.csv and comparisons.csv rewritten, the plot redrawn."""
    import pandas as pd

    earlier = previous_run(out)
    if earlier is None:
        raise SystemExit(f"{out}: no requests.jsonl, summary.csv and summary.md to reanalyse")
    rows = earlier.rows
    table = summarize(rows, runs_of(earlier.table))
    for line, old in zip(table, earlier.table):  # wall time is kept rounded: keep its rate as printed
        line["output_tokens_per_s"] = old["output_tokens_per_s"]
    families = comparisons(rows)
    trials = (pd.read_csv(out / "trials.csv").to_dict("records") if (out / "trials.csv").exists() else None)
    (out / "summary.md").write_text(markdown(
        table, earlier.command, len({row["context"] for row in rows}), earlier.ratio, earlier.model, earlier.pool,
        families, 1 + max(row["question"] for row in rows),
        "rounds" if "--arrivals rounds" in earlier.command else "together", dead_questions(rows), trials,
        earlier.added or None, record_code(out, None), earlier.layer_groups))
    pd.DataFrame(table).to_csv(out / "summary.csv", index=False)
    write_comparisons(families, out)
    plot(table, out / "shared_context.png")
    print((out / "summary.md").read_text())
    return 0


def command_line(args, parser) -> str:
    """The command the summary records: the script with every option not at its default, but
    ``--configs`` (which configurations of that command ran)."""
    return "python experiments/shared_context.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in (("contexts", args.contexts), ("questions", args.questions),
                                                     ("ratio", args.ratio), ("kv_cache_gib", args.kv_cache_gib),
                                                     ("pool_blocks", args.pool_blocks), ("trials", args.trials),
                                                     ("layer_groups", args.layer_groups))
        if v != parser.get_default(k)) + (" --context-only" if args.context_only else "") + (
        f" --arrivals {args.arrivals}" if args.arrivals != "together" else "") + (
        "" if args.out == OUT else f" --out {args.out}")


def shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=8)
    parser.add_argument("--questions", type=int, default=QUESTIONS, help="questions per context")
    parser.add_argument("--arrivals", choices=ARRIVALS, default="together",
                        help="together: every request at once; rounds: one question of each context per round, "
                             "each round once the one before has finished")
    parser.add_argument("--context-only", action="store_true",
                        help="full cache and the context-compressing configurations only (no query-aware ones)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0,
                        help="the KV pool: large enough by default that no configuration waits for blocks, so "
                             "its peak is what it asks for, not the pool's size")
    parser.add_argument("--pool-blocks", type=int, default=None,
                        help="the KV pool in blocks instead (small enough that full cache must queue: the requests "
                             "run at once and the throughput are then what the pool allows)")
    parser.add_argument("--trials", type=int, default=1,
                        help="run every configuration this many times on the one engine, in the listed order in odd "
                             "trials and reversed in even ones; throughput ratios with intervals over trials")
    parser.add_argument("--layer-groups", type=int, default=1,
                        help="the engine's attention layers as this many KV cache groups (engine.layer_groups); above "
                             "1 adds 'kvzip context schedule=kvzip', KVzip's own allocation across the groups")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--configs", default=None,
                        help="run only these configurations (comma-separated, as the summary names them, e.g. "
                             "'kvzip context'), full cache always beside them; where --out holds a run of the same "
                             "command without --configs, they join it (its configurations kept, full cache checked)")
    parser.add_argument("--reanalyse", action="store_true",
                        help="no engine: recompute the statistics from the committed requests.jsonl and the timings "
                             "and KV counts in summary.csv, and rewrite summary.md and summary.csv")
    args = parser.parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.out)
    if args.contexts < 2 or args.questions < 2 or not 0 < args.ratio < 1:
        parser.error("--contexts and --questions must be at least 2 and --ratio in (0, 1)")
    if args.trials < 1 or args.trials == 2 or (args.pool_blocks is not None and args.pool_blocks < 1):
        parser.error("--trials must be 1 or at least 3 (an interval over two trials says nothing), --pool-blocks positive")
    try:
        named = selected(args.context_only, args.configs, args.layer_groups)
    except ValueError as error:
        parser.error(str(error))
    command = command_line(args, parser)
    joining = None
    if args.configs is not None:
        if args.trials > 1:
            parser.error("--configs with --trials: the trials' order and ratios are over every configuration")
        joining = previous_run(args.out)
        if joining is not None and joining.command != command:
            parser.error(f"{args.out} holds a run of `{joining.command}`, not of `{command}`: --configs adds to a run of "
                         "the same command (or give another --out)")

    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from harness.config import ConfigError, resolve_model_path, run_settings
    from harness.engine.llm import Engine
    from harness.tasks.metrics import score_sample

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        try:  # the run's checks, G against the model's layers among them, before it loads
            run = run_settings(compose(config_name="config", overrides=["model=smollm2-135m",
                                                                        f"engine.layer_groups={args.layer_groups}"]))
        except ConfigError as error:
            parser.error(f"--layer-groups {args.layer_groups}: {error}")
    model_path = resolve_model_path(run.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    shared = workload(args.contexts, questions=args.questions)
    workload_prompts = [(s, prompts_of(s, tokenizer, run.model.max_prompt_tokens)) for s in shared]
    from dataclasses import replace

    # vLLM keeps one null block out of the pool: one more than the blocks asked for
    blocks = None if args.pool_blocks is None else args.pool_blocks + 1
    # (engine.layer_groups came with the run's settings above, checked there)
    engine_settings = replace(run.engine, kv_cache_gib=args.kv_cache_gib, num_kv_blocks=blocks)
    engine = Engine(model_path, run.model, engine_settings, run.block_size, seed=run.seed, prefix_caching=True)
    rows, runs, trials = [], {}, []
    try:
        for trial, order in enumerate(trial_orders(list(named), args.trials), start=1):
            for position, name in enumerate(order):
                requests = requests_for(named[name], workload_prompts, args.ratio, tokenizer)
                results, wall, ledger = run_configuration(engine, requests, args.arrivals)
                output_tokens = sum(r.output_tokens for r in results)
                trials.append({"configuration": name, "trial": trial, "position": (trial - 1) * len(order) + position,
                               "wall_s": round(wall, 3), "output_tokens": output_tokens,
                               "output_tok_s": round(output_tokens / wall, 3),
                               "running_peak": ledger["running_requests_peak"],
                               "kv_blocks_peak": ledger["kv_blocks_used_peak"],
                               "kv_blocks_mean": round(ledger["kv_blocks_used_mean"], 1),
                               "preemptions": sum(r.preemptions for r in results),
                               "outputs_digest": hashlib.sha1(json.dumps([r.token_ids for r in results]).encode()).hexdigest()})
                print(f"[shared_context] trial {trial} {name}: {wall:.1f}s, peak {ledger['kv_blocks_used_peak']} blocks, "
                      f"{ledger['running_requests_peak']} running at peak", flush=True)
                if trial > 1:
                    continue  # accuracy, blocks and counts from the first trial (later trials check the outputs are the same)
                runs[name] = (wall, ledger)
                for request, result in zip(requests, results):
                    text, answers = request.shared.questions[request.question]
                    rows.append({"configuration": name, "task": request.shared.task, "context": request.shared.id,
                                 "question": request.question, "prompt_tokens": result.prompt_tokens,
                                 "context_tokens": request.settings.get("context_tokens"),
                                 "prediction": result.text, "answers": list(answers), "output_tokens": result.output_tokens,
                                 "score": score_sample(request.shared.task, result.text, list(answers))})
        pool = engine.facts()["kv_pool_blocks"]
    finally:
        engine.close()
    table = summarize(rows, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    if joining is not None:
        if joining.pool != pool:
            raise SystemExit(f"{args.out}'s run had a pool of {joining.pool} blocks, this one {pool}: not joined "
                             f"(this run's figures: {[(line['configuration'], line['later']) for line in table]})")
        rows, merged, check = merge(joining.rows, joining.table, rows, table,
                                    [name_of(c) for c in configurations(False, args.layer_groups)])
        added = [entry for entry in joining.added if not set(entry["configurations"]) <= set(check["configurations"])]
        added.append({"command": command + f" --configs {shell_quote(args.configs)}", **check})
        (args.out / ADDED).write_text(json.dumps(added, indent=1) + "\n")
        record_code(args.out, added[-1]["command"])
        pd.DataFrame(merged).to_csv(args.out / "summary.csv", index=False)
        with open(args.out / "requests.jsonl", "w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
        # summary.md (the earlier run's command, model and pool), comparisons and plot from the joined files
        return reanalyse(args.out)
    families = comparisons(rows)
    if args.configs is not None:  # a run of some configurations only, in a directory of its own
        command += f" --configs {shell_quote(args.configs)}"
    trials = trials if args.trials > 1 else None
    if trials:
        pd.DataFrame(trials).to_csv(args.out / "trials.csv", index=False)
    (args.out / PROVENANCE).unlink(missing_ok=True)  # a new study: no earlier run's code
    code = record_code(args.out, command)
    (args.out / "summary.md").write_text(markdown(table, command, args.contexts, args.ratio, run.model.name, pool,
                                                  families, args.questions, args.arrivals, dead_questions(rows), trials,
                                                  code=code, layer_groups=args.layer_groups))

    pd.DataFrame(table).to_csv(args.out / "summary.csv", index=False)
    write_comparisons(families, args.out)
    with open(args.out / "requests.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    plot(table, args.out / "shared_context.png")
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One serving benchmark run through vLLM's own ``benchmark()`` (vllm/benchmarks/serve.py:786), and a
sweep of configurations x request rates x trials on one ``vllm serve``.

A run: the prefix cache emptied (``Server.reset_prefix_cache``), the arrival process seeded (vLLM
draws the gaps from ``np.random.gamma``, serve.py get_request; burstiness 1.0 is a Poisson process),
then ``benchmark()`` (``harness.engine.bench_client``) on the workload's ``SampleRequest``s with greedy
sampling (``temperature: 0`` in ``extra_body``), the goodput SLOs, and the KV usage gauge sampled
beside it. vLLM's initial test request is skipped: it would send the workload's first request
before the timed run and leave its context in the prefix cache; the server is already healthy
(``Server.start``). Each run is saved in the JSON ``vllm bench serve --save-result
--save-detailed`` writes (serve.py:2250-2283 and :2397-2410: the setup and traffic keys, then
``benchmark()``'s result with ``generated_texts`` and ``errors``), the sweep's own keys added at
the top level as ``--metadata KEY=VALUE`` adds them, and the gauge samples beside it. The eviction
scheduler's ledger (``GET /kv_eviction/state``, ``harness.engine.frontend``: the worker's model,
query-capture, eviction and reconstruction seconds, the steps) is reset before the run and read
after it, and kept beside it too (``.ledger.json``).

A sweep: every configuration at every rate in every trial, on one server (a configuration is a
per-request setting). Counterbalanced: rates ascending and configurations in the listed order in odd
trials, both reversed in even ones; within a trial and rate every configuration gets the same
arrival times (one seed per trial and rate), so its ratio to full cache compares like with like.

A conversation workload (``Workload.turns`` > 1) runs through ``bench_client.conversations``
instead of ``benchmark()``: the same arrival process draws when each conversation's first turn goes
out (the same times for every configuration), each later turn goes out as soon as the one before
returns (no think time), and vLLM's ``calculate_metrics`` reports over every turn. Its
``queue_times`` are 0 (``benchmark()`` sets ``client_queue_time`` in its own concurrency wrapper,
serve.py:984, which a conversation, holding its slot for all its turns, does not go through); its saved
run adds each turn's answer ids and cached prompt tokens, from which ``turn_items`` rebuilds the
later turns' prompts for ``--summary-only`` and ``--verify``.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from harness.engine.bench_client import NOT_SENT
from harness.serving.server import GaugeSampler, Server, gauge_summary
from harness.serving.workloads import Workload, next_request, rate_unit, sample_requests, score, turn_items

# Stated before any run: a request is good when its first token comes within TTFT and its
# later tokens at TPOT or faster (ms; vLLM's --goodput format)
DEFAULT_GOODPUT = "ttft:5000 tpot:250"
PERCENTILES = (50.0, 90.0, 99.0)
CAPACITY_FRACTIONS = (0.7, 1.2, 2.0, 4.0)


def parse_goodput(text: str) -> dict[str, float]:
    """``"ttft:5000 tpot:250"`` -> {"ttft": 5000.0, "tpot": 250.0}, by vLLM's own parser and checks."""
    from harness.engine import bench_client

    return bench_client.parse_goodput(text)


@dataclass
class Bench:
    """What every run of a sweep shares: the server, the model's id and tokenizer, the workload,
    the compression ratio and the SLOs."""

    server: Server
    model: str
    tokenizer: object
    workload: Workload
    ratio: float
    goodput: dict[str, float] = field(default_factory=lambda: parse_goodput(DEFAULT_GOODPUT))

    def run(self, configuration: str, rate: float, seed: int, metadata: dict | None = None,
            max_concurrency: int | None = None) -> tuple[dict, list, dict | None]:
        """One run of vLLM's ``benchmark()``: its result in ``vllm bench serve``'s saved format (with
        ``metadata`` on top), the gauge samples taken beside it, and the scheduler's state over the
        run (its ledger reset first; None from a server without the eviction scheduler)."""
        import numpy as np

        from harness.engine.bench_client import benchmark, conversations

        requests = sample_requests(self.workload, configuration, self.ratio)
        self.server.reset_prefix_cache()
        self.server.eviction_state(reset=True)
        random.seed(seed)
        np.random.seed(seed)
        with GaugeSampler(self.server) as sampler:
            if self.workload.turns > 1:  # a conversation's later turns are sent as the earlier ones return
                result = conversations(self.server.base_url, self.model, self.tokenizer, requests, self.workload.turns,
                                       next_request(self.workload, self.tokenizer, configuration, self.ratio), rate,
                                       ignore_eos=self.workload.ignore_eos, goodput=self.goodput, percentiles=PERCENTILES, extra_body={"temperature": 0.0},
                                       max_concurrency=max_concurrency)
            else:
                result = benchmark(self.server.base_url, self.model, self.tokenizer, requests, rate,
                                   ignore_eos=self.workload.ignore_eos, goodput=self.goodput, percentiles=PERCENTILES,
                                   extra_body={"temperature": 0.0}, max_concurrency=max_concurrency)
        saved = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "vllm", "backend": "vllm",
                 "label": None, "model_id": self.model, "tokenizer_id": self.model,
                 "num_prompts": len(requests) * self.workload.turns,
                 **{key: str(value) for key, value in (metadata or {}).items()},
                 "request_rate": rate if rate < float("inf") else "inf", "burstiness": 1.0,
                 "max_concurrency": max_concurrency,
                 **result}
        return saved, sampler.samples, self.server.eviction_state()


def run_name(trial: int, rate: float, configuration: str) -> str:
    return f"trial{trial}-rate{rate:g}-{configuration.replace(' ', '_')}"


def plan(configurations: list[str], rates: list[float], trials: int) -> list[dict]:
    """Every run in the order it runs: per trial the rates ascending and the configurations in the
    listed order (odd trials), both reversed in even ones; ``position`` counts runs from 0."""
    runs = []
    for trial in range(1, trials + 1):
        backwards = trial % 2 == 0
        for rate in (sorted(rates, reverse=backwards)):
            for configuration in (configurations[::-1] if backwards else configurations):
                runs.append({"trial": trial, "rate": rate, "configuration": configuration, "position": len(runs)})
    return runs


def arrival_seed(seed: int, trial: int, rate: float, rates: list[float]) -> int:
    """One seed per trial and rate: every configuration of it gets the same arrival times."""
    return seed + 1000 * trial + sorted(rates).index(rate)


def rates_from_capacity(bench: Bench, fractions: tuple[float, ...], out: Path, seed: int) -> list[float]:
    """Full cache's capacity measured by vLLM's benchmark with every request sent at once (rate
    inf): its request throughput; the sweep's rates are ``fractions`` of it (below and above)."""
    saved, samples, state = bench.run("full", float("inf"), seed, {"configuration": "full", "purpose": "capacity"})
    write_run(out, "capacity", saved, samples, state)
    capacity = arrival_throughput(saved)
    print(f"[serving] full cache's capacity: {capacity:.3f} {rate_unit(bench.workload.turns)} "
          f"({saved['output_throughput']:.1f} output tok/s) with all {saved['num_prompts']} at once", flush=True)
    return [float(f"{capacity * fraction:.3g}") for fraction in fractions]


def arrival_throughput(saved: dict) -> float:
    """What arrives per second, completed: requests, or whole conversations (``conversations``)."""
    return saved.get("conversation_throughput", saved["request_throughput"])


def write_run(out: Path, name: str, saved: dict, samples: list, state: dict | None = None) -> None:
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    (runs / f"{name}.json").write_text(json.dumps(saved))
    (runs / f"{name}.gauges.json").write_text(json.dumps(samples))
    if state is not None:
        (runs / f"{name}.ledger.json").write_text(json.dumps(state))


# the ledger's figures a run's row keeps (``harness.engine.scheduler.Ledger.snapshot``): the steps that
# scheduled tokens, and the worker's seconds over the steps that ran an evicting request (model_s
# includes capture_s, evict_s includes reconstruct_s; reconstruct_s only where a policy reconstructs)
LEDGER_FIGURES = ("steps", "model_s", "capture_s", "evict_s", "reconstruct_s")


def ledger_figures(state: dict | None) -> dict:
    """A run's ledger figures for its row (none for a run saved without its ledger)."""
    if state is None:
        return {}
    ledger = state["ledger"]
    return {f"ledger_{key}": ledger.get(key) for key in LEDGER_FIGURES}


def run_row(entry: dict, saved: dict, samples: list, items: list, state: dict | None = None
            ) -> tuple[dict, list[dict]]:
    """A run's figures (one row of ``runs.csv``, with its ledger's where ``state`` is given) and its
    requests' rows (``items``, in the order sent), each scored."""
    scores = [score(item, text) for item, text in zip(items, saved["generated_texts"])]
    gauge = gauge_summary(samples)
    row = {**entry, "completed": saved["completed"], "failed": saved["failed"], "duration_s": saved["duration"],
           "output_tok_s": saved["output_throughput"], "request_goodput": saved["request_goodput"],
           "request_throughput": saved["request_throughput"], "total_output_tokens": saved["total_output_tokens"],
           **{key: saved.get(key) for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                                              "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "mean_e2el_ms")},
           "max_concurrent_requests": saved.get("max_concurrent_requests"), "kv_usage_mean": gauge["mean"],
           "kv_usage_peak": gauge["peak"], "gauge_samples": gauge["samples"], **ledger_figures(state)}
    scored = [s for s in scores if s is not None]
    row["accuracy"] = 100 * sum(scored) / len(scored) if scored else None
    requests = [{"configuration": entry["configuration"], "rate": entry["rate"], "trial": entry["trial"],
                 "context": item.context, "question": item.question, "task": item.task,
                 "prompt_tokens": len(item.prompt), "context_tokens": item.context_tokens,
                 "output_tokens": tokens, "ttft_s": ttft, "e2el_s": latency, "error": error or None,
                 "score": value, "prediction": text}
                for item, text, tokens, ttft, latency, error, value in zip(
                    items, saved["generated_texts"], saved["output_lens"], saved["ttfts"], saved["latencies"],
                    saved["errors"], scores)]
    if "cached_tokens" in saved:  # conversations: what each turn found cached, and the history it held
        for request, cached in zip(requests, saved["cached_tokens"]):
            request["cached_tokens"] = cached
            if (request["error"] or "").startswith(NOT_SENT):
                request["prompt_tokens"] = None  # never made: its conversation ended before it
        later = [r for r in requests if r["question"] > 0 and r["cached_tokens"] is not None and not r["error"]]
        ledger = (state or {}).get("ledger") or {}
        row.update(later_turn_computed=mean_of([r["prompt_tokens"] - r["cached_tokens"] for r in later]),
                   kv_blocks_mean=ledger.get("kv_blocks_used_mean"), kv_blocks_peak=ledger.get("kv_blocks_used_peak"),
                   later_turns=len(later), chain_hits=chain_hits(requests, saved))
    return row, requests


def chain_hits(requests: list[dict], saved: dict) -> int:
    """Later turns that took the turn before's compressed cache, counted per turn from what the
    server answered: vLLM reports a request's cached tokens at its first scheduling
    (vllm/v1/core/sched/scheduler.py:1075-1081), and a chained turn that takes its entry reports the
    entry's logical length, the turn before's prompt and all but its last output token
    (harness/engine/shared_contexts.py). (The ledger's ``chain_hits`` counts a turn preempted and
    taking its entry again twice.) A miss that recompresses the pristine history reports the whole
    blocks the prefix cache held of it instead, which can equal that length only where it ends on a
    block boundary."""
    hits = 0
    for t, request in enumerate(requests):
        if request["question"] == 0 or request["error"] or request["cached_tokens"] is None:
            continue
        before = requests[t - 1]
        hits += request["cached_tokens"] == before["prompt_tokens"] + len(saved["output_token_ids"][t - 1]) - 1
    return hits



def mean_of(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def sent_items(workload: Workload, tokenizer, saved: dict) -> list:
    """The requests a run sent, in its result's order: the workload's, and a conversation's later
    turns as the answers before them made them (``output_token_ids``)."""
    return turn_items(workload, tokenizer, saved.get("output_token_ids", []))


def sweep(bench: Bench, configurations: list[str], rates: list[float], trials: int, out: Path, seed: int = 0
          ) -> tuple[list[dict], list[dict]]:
    """Every run of ``plan``: each run's saved JSON and gauges under ``out/runs/``; returns the runs'
    rows and the requests' rows."""
    rows, requests = [], []
    runs = plan(configurations, rates, trials)
    for entry in runs:
        if not bench.server.alive():
            raise RuntimeError(f"vllm serve died:\n{bench.server.log_tail()}")
        metadata = {"configuration": entry["configuration"], "trial": entry["trial"], "position": entry["position"],
                    "workload": bench.workload.name, "ratio": bench.ratio}
        saved, samples, state = bench.run(entry["configuration"], entry["rate"],
                                          arrival_seed(seed, entry["trial"], entry["rate"], rates), metadata)
        write_run(out, run_name(entry["trial"], entry["rate"], entry["configuration"]), saved, samples, state)
        row, scored = run_row(entry, saved, samples, sent_items(bench.workload, bench.tokenizer, saved), state)
        rows.append(row)
        requests += scored
        accuracy = "" if row["accuracy"] is None else f", accuracy {row['accuracy']:.1f}"
        print(f"[serving] {entry['position'] + 1}/{len(runs)} trial {entry['trial']} rate {entry['rate']:g} "
              f"{entry['configuration']}: {row['completed']}/{saved['num_prompts']} completed, "
              f"{row['output_tok_s']:.1f} output tok/s, goodput {row['request_goodput']:.3f} req/s, "
              f"median TTFT {row['median_ttft_ms']:.0f} ms, median TPOT {row['median_tpot_ms']:.1f} ms, "
              f"KV usage mean {fraction(row['kv_usage_mean'])} peak {fraction(row['kv_usage_peak'])}{accuracy}",
              flush=True)
    return rows, requests


ALONE = 4  # requests per configuration sent again one at a time after the sweep


def parted_at(text: str, other: str) -> int | None:
    """The first character where two texts part (the shorter one's length where one extends the
    other), or None where they are equal."""
    return next((i for i, (a, b) in enumerate(zip(text, other)) if a != b),
                None if len(text) == len(other) else min(len(text), len(other)))


def alone_run_name(configuration: str) -> str:
    return f"alone-{configuration.replace(' ', '_')}"


def served_alone(bench: Bench, configurations: list[str], requests: list[dict], out: Path) -> list[dict]:
    """Do requests served under load generate what they generate alone? The first ``ALONE`` requests
    of the workload, per configuration, sent one at a time (vLLM's ``max_concurrency`` 1, the prefix
    cache emptied first) and their texts compared with the same requests' in the sweep's first trial
    at its highest rate (greedy: equal texts, or the first character where they part). Texts only: a
    difference is reported, not checked for a near tie."""
    from dataclasses import replace

    top = max(r["rate"] for r in requests)
    turns = bench.workload.turns  # conversations are replayed whole, one after another
    sample = bench.workload.items[:math.ceil(ALONE / turns) * turns]
    alone = replace(bench, workload=replace(bench.workload, items=sample))
    checked = []
    for configuration in configurations:
        saved, samples, state = alone.run(configuration, float("inf"), 0, {"configuration": configuration,
                                                                           "purpose": "alone"}, max_concurrency=1)
        write_run(out, alone_run_name(configuration), saved, samples, state)
        served = {(r["context"], r["question"]): r["prediction"] for r in requests
                  if r["configuration"] == configuration and r["trial"] == 1 and r["rate"] == top}
        for item, text in zip(sample, saved["generated_texts"]):
            parted = parted_at(text, served[(item.context, item.question)])
            checked.append({"configuration": configuration, "context": item.context, "question": item.question,
                            "rate": top, "equal": parted is None, "parted_at_char": parted})
    (out / "alone.json").write_text(json.dumps(checked, indent=1) + "\n")
    return checked


def fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"

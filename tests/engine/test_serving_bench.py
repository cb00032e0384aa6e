"""vLLM's own serving benchmark against ``vllm serve`` with the eviction scheduler (issue 64): the
project's sweep (``harness.serving``: vLLM's ``benchmark()`` with per-request eviction settings)
and ``vllm bench serve`` as users type it, each driving a handful of requests on the tiny model,
their saved metrics files checked (every request completed, none failed, output tokens counted,
the KV usage gauge sampled); a per-request setting the server must refuse comes back as an error,
so the settings do reach the server; the scheduler's ledger is read through the served app
(``GET /kv_eviction/state``) and starts afresh on reset. One server for all of them (CI time)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.engine_support import BLOCK, model_path

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from harness.serving.server import Server

    with Server(model_path("tiny"), tmp_path_factory.mktemp("serve") / "vllm.log", pool_bytes=256 * 2**20,
                block_size=BLOCK, max_model_len=4096, max_num_batched_tokens=4096) as running:
        yield running
        assert running.alive(), f"vllm serve died during the tests:\n{running.log_tail()}"


def test_the_sweep_drives_vllms_benchmark_with_per_request_eviction(server, tmp_path):
    """Two configurations (full cache, PagedEviction compressing the shared context) at one rate:
    vLLM's saved result per run with every request completed and its text kept, the gauge sampled,
    and the summary written."""
    from harness.serving.experiment import Options, run

    options = Options(workload="shared_context", configurations=["full", "paged context"], out=tmp_path,
                      command="test", model="tiny", rates=[8.0], trials=1, goodput="ttft:5000 tpot:500",
                      workload_options={"contexts": 2, "questions": 2, "max_prompt_tokens": 1500})
    text = run(options, server=server)
    for configuration in ("full", "paged_context"):
        saved = json.loads((tmp_path / "runs" / f"trial1-rate8-{configuration}.json").read_text())
        assert saved["completed"] == saved["num_prompts"] == 4 and saved["failed"] == 0
        assert saved["errors"] == [""] * 4 and len(saved["generated_texts"]) == 4
        assert saved["total_output_tokens"] == sum(saved["output_lens"]) > 0
        assert saved["request_rate"] == 8.0 and saved["burstiness"] == 1.0 and saved["configuration"] == configuration.replace("_", " ")
        assert saved["request_goodput"] is not None and "median_tpot_ms" in saved
        gauges = json.loads((tmp_path / "runs" / f"trial1-rate8-{configuration}.gauges.json").read_text())
        assert gauges and all("vllm:kv_cache_usage_perc" in sample for sample in gauges)
        assert all(0 <= (sample["vllm:kv_cache_usage_perc"] or 0) <= 1 for sample in gauges)
        # 4 requests of about 1,500 tokens each: the run held blocks. Read from the run's ledger (reset
        # before it, read after it), not from the gauge: the run lasts about a second on the tiny model,
        # and the gauge, sampled every 0.5 s, read 0 in every sample of one CI run under load.
        ledger = json.loads((tmp_path / "runs" / f"trial1-rate8-{configuration}.ledger.json").read_text())["ledger"]
        # (at least one prompt's context, about 1,400 tokens, compressed to half: 21 blocks of 32)
        assert ledger["kv_blocks_used_peak"] >= 16 and ledger["steps"] > 0
    assert "| 8 | paged context | 4/0 |" in text and (tmp_path / "pareto.png").exists()
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(row["score"] is not None and row["error"] is None for row in rows)
    # the sample sent again one at a time: vLLM's max_concurrency 1, compared with the sweep's texts
    alone = json.loads((tmp_path / "alone.json").read_text())
    assert [(a["configuration"], a["rate"]) for a in alone] == [("full", 8.0)] * 4 + [("paged context", 8.0)] * 4
    assert all(isinstance(a["equal"], bool) for a in alone)
    saved = json.loads((tmp_path / "runs" / "alone-paged_context.json").read_text())
    assert saved["max_concurrency"] == 1 and saved["completed"] == 4
    assert "## Served under load against sent alone" in text and "* paged context: " in text
    # the summaries again from the saved runs alone, with no server: the same text
    from harness.serving.experiment import summarize, verify

    assert summarize(tmp_path) == text
    # --verify: the summaries recompute and the sample replays at this code, each replayed text against
    # the committed text of the same request sent alone; a committed alone text that is not what the
    # server generates, or a summary edited by hand, is named as moved
    record = verify(tmp_path, server=server)
    assert record["verdict"] == "verified" and len(record["replayed"]) == 8, record["moved"]
    assert {entry["against"] for entry in record["replayed"]} == {"alone"} and len(record["under_load"]) == 8
    assert json.loads((tmp_path / "verified.json").read_text())["verdict"] == "verified"
    edited = [dict(row, prediction=row["prediction"] + " (edited)") if row["configuration"] == "full" else row
              for row in rows]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(row) + "\n" for row in edited))
    (tmp_path / "summary.md").write_text(text.replace("| 8 | paged context | 4/0 |", "| 8 | paged context | 3/1 |"))
    alone_full = tmp_path / "runs" / "alone-full.json"
    saved = json.loads(alone_full.read_text())
    alone_full.write_text(json.dumps(dict(saved, generated_texts=[t + " (edited)" for t in saved["generated_texts"]])))
    moved = verify(tmp_path, server=server)["moved"]
    assert any(m.startswith("summary.md:") for m in moved) and any(m.startswith("requests.jsonl:") for m in moved)
    assert sum("full " in m and "parts from the committed one (alone)" in m for m in moved) == 4


def test_conversations_follow_their_answers_and_the_chain_takes_each_turn_before(server, tmp_path):
    """multi_turn through ``harness.engine.bench_client.conversations``: 2 conversations x 3 turns
    for full cache, recompression and the chain, at one rate. Every turn completes; each later turn
    starts after the one before returned and is that turn's prompt, its answer's token ids and the
    next question (rebuilt from the saved ids, the lengths the server counted); full cache finds
    its history cached; the chain takes the turn before's compressed cache at every later turn (4
    hits) and computes fewer tokens than recompression; the summaries rebuild from the saved runs."""
    from harness.serving.experiment import Options, run, summarize

    configurations = ["full", "paged context", "paged context chained"]
    options = Options(workload="multi_turn", configurations=configurations, out=tmp_path, command="test", model="tiny",
                      rates=[4.0], trials=1, goodput="ttft:5000 tpot:500",
                      workload_options={"conversations": 2, "turns": 3, "max_prompt_tokens": 2500})
    text = run(options, server=server)
    runs = {name: json.loads((tmp_path / "runs" / f"trial1-rate4-{name.replace(' ', '_')}.json").read_text())
            for name in configurations}
    for name, saved in runs.items():
        assert saved["completed"] == saved["num_prompts"] == 6 and saved["failed"] == 0, (name, saved["errors"])
        assert saved["conversations"] == 2 and saved["turns"] == 3 and saved["conversation_throughput"] > 0
        for c in range(2):
            turns = range(3 * c, 3 * c + 3)
            for t in list(turns)[1:]:
                assert saved["start_times"][t] >= saved["start_times"][t - 1] + saved["latencies"][t - 1]
                assert saved["input_lens"][t] > saved["input_lens"][t - 1] + len(saved["output_token_ids"][t - 1])
                assert len(saved["output_token_ids"][t]) == saved["output_lens"][t]
    full, again, chain = (runs[name] for name in configurations)
    later = [t for t in range(6) if t % 3]
    # full cache: the history's whole blocks come from the prefix cache
    assert all(full["cached_tokens"][t] >= (full["input_lens"][t - 1] // BLOCK) * BLOCK for t in later)
    computed = {name: sum(runs[name]["input_lens"][t] - runs[name]["cached_tokens"][t] for t in later)
                for name in configurations}
    assert computed["paged context chained"] < computed["paged context"]
    ledger = json.loads((tmp_path / "runs" / "trial1-rate4-paged_context_chained.ledger.json").read_text())["ledger"]
    assert ledger["shared_contexts"]["chain_hits"] == 4  # every later turn; each first turn is a miss
    assert "## Conversations" in text and "| 4 | paged context chained |" in text and "| 4/4 |" in text
    assert "conv/s" in text
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and all(row["error"] is None and row["cached_tokens"] is not None for row in rows)
    # whole conversations sent again alone, one turn after another, per configuration: the first
    # ALONE = 4 requests' conversations (two of three turns)
    alone = json.loads((tmp_path / "alone.json").read_text())
    assert [(a["configuration"], a["question"]) for a in alone] == [(n, t) for n in configurations for _ in range(2)
                                                                    for t in range(3)]
    assert summarize(tmp_path) == text


def test_a_setting_the_server_refuses_fails_the_request(server):
    """A boundary past the prompt's end is refused (docs/serving.md; on a stream, as the benchmark sends,
    as an error event): the per-request override reached the server, the benchmark counts the request
    as failed, and the server goes on."""
    import asyncio

    from vllm.benchmarks.datasets.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    setting = {"policy": "paged", "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
               "context_tokens": 10_000}
    requests = [SampleRequest(prompt=list(range(100, 300)), prompt_len=200, expected_output_len=8,
                              request_overrides={"vllm_xargs": {"kv_eviction": json.dumps(setting)}})] * 2
    result = asyncio.run(benchmark(
        task_type=TaskType.GENERATION, endpoint_type="vllm", api_url=f"{server.base_url}/v1/completions",
        base_url=server.base_url, model_id=model_path("tiny"), model_name=model_path("tiny"), tokenizer=None,
        input_requests=requests, logprobs=None, request_rate=float("inf"), burstiness=1.0, disable_tqdm=True,
        num_warmups=0, profile=False, selected_percentile_metrics=["e2el"], selected_percentiles=[50.0],
        ignore_eos=True, goodput_config_dict={}, max_concurrency=None, lora_modules=None, extra_headers=None,
        extra_body={"temperature": 0.0}, ready_check_timeout_sec=0))
    assert result["completed"] == 0 and result["failed"] == 2
    # The benchmark streams, and vLLM answers a refused stream with HTTP 200 and an error event
    # instead of a first token, which vLLM's client records as a failure with no TTFT
    # (endpoint_request_func.py); a non-streamed request gets the 400 (tests/engine/test_serve.py).
    assert all(error for error in result["errors"]), result["errors"]
    assert server.alive()


def test_vllm_bench_serve_as_typed_with_eviction_in_extra_body(server, tmp_path):
    """``vllm bench serve`` (the console script) on vLLM's prefix_repetition dataset with PagedEviction
    for every request through ``--extra-body``: its saved metrics file counts every request."""
    settings = json.dumps({"vllm_xargs": {"kv_eviction": json.dumps({"policy": "paged", "budget": 2 * BLOCK})}})
    command = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--base-url", server.base_url,
               "--model", model_path("tiny"), "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", "256", "--prefix-repetition-suffix-len", "32",
               "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "16", "--num-prompts", "4",
               "--request-rate", "8", "--burstiness", "1.0", "--temperature", "0", "--ignore-eos",
               "--extra-body", settings, "--goodput", "ttft:5000", "tpot:500", "--save-result", "--save-detailed",
               "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["completed"] == 4 and saved["failed"] == 0 and saved["errors"] == [""] * 4
    assert saved["total_output_tokens"] == 4 * 16 and saved["request_goodput"] is not None


def complete(server, prompt: list[int], setting: dict | None = None) -> None:
    body = {"model": model_path("tiny"), "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    if setting is not None:
        body["vllm_xargs"] = {"kv_eviction": json.dumps(setting)}
    request = urllib.request.Request(f"{server.base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=120).read().decode())
    assert answer["usage"]["completion_tokens"] == 8


def test_the_served_ledger_counts_what_was_served_and_resets(server):
    """``GET /kv_eviction/state`` (what the sweep reads, ``harness.serving.server.Server.eviction_state``)
    answers the engine core's ledger across the process boundary, counts the steps of what was
    served, times the worker only on steps that run an evicting request, and starts afresh on reset."""
    server.reset_prefix_cache()
    prompt = list(range(400, 600))  # 200 tokens: PagedEviction at 2 blocks evicts in its prefill
    fresh = server.eviction_state(reset=True)
    ledger = fresh["ledger"]
    assert fresh["settings"] is None and fresh["prefix_caching"]  # no server default: settings per request
    assert (ledger["steps"], ledger["model_s"], ledger["evict_s"]) == (0, 0.0, 0.0)

    complete(server, prompt)  # full cache: its steps count, but no step of it is timed
    full = server.eviction_state()["ledger"]
    assert full["steps"] >= 8 and full["model_s"] == 0.0 and full["evicted_tokens"] == 0

    server.eviction_state(reset=True)
    started = time.perf_counter()
    for _ in range(2):
        complete(server, prompt, {"policy": "paged", "budget": 2 * BLOCK})
    elapsed = time.perf_counter() - started
    paged = server.eviction_state()["ledger"]
    # the reset dropped full cache's steps; both requests' prefill evictions and steps counted
    assert 2 * 8 <= paged["steps"] < full["steps"] + 2 * 8
    # each keeps at most budget + a block and a half of its 200 tokens (policies/paged.py), once in its prefill
    assert paged["evictions"]["prefill"] == 2 and paged["evicted_tokens"] >= 2 * (len(prompt) - 2 * BLOCK - 48)
    # the worker's seconds lie within the wall time the client saw (the split's "other" is not negative)
    assert 0 < paged["model_s"] and 0 < paged["evict_s"] and paged["model_s"] + paged["evict_s"] < elapsed
    assert server.alive()

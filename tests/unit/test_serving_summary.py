"""The serving sweep's plan and summaries (harness/serving/bench.py, summary.py, server.py) on
hand-made runs: counterbalanced order, the same arrivals for every configuration of a trial and
rate, ratios to full cache in the same trial, accuracy paired with full cache, the gauge parse."""
from __future__ import annotations

import math

import pytest

from harness.serving.bench import arrival_seed, parse_goodput, plan
from harness.serving.server import block_bytes, gauge_summary, parse_metrics
from harness.serving.summary import ACCURACY_MARGIN, TARGET, accuracy_table, headline, markdown, rate_table, ratio_cell


def test_the_plan_reverses_rates_and_configurations_in_even_trials():
    runs = plan(["full", "paged context", "snapkv context"], [0.1, 0.4, 0.2], 4)
    assert len(runs) == 4 * 3 * 3 and [r["position"] for r in runs] == list(range(36))
    first, second = runs[:9], runs[9:18]
    assert [r["rate"] for r in first[::3]] == [0.1, 0.2, 0.4] and [r["rate"] for r in second[::3]] == [0.4, 0.2, 0.1]
    assert [r["configuration"] for r in first[:3]] == ["full", "paged context", "snapkv context"]
    assert [r["configuration"] for r in second[:3]] == ["snapkv context", "paged context", "full"]
    # over an even number of trials every configuration has the same mean position
    means = {name: sum(r["position"] for r in runs if r["configuration"] == name) / 12 for name in
             ("full", "paged context", "snapkv context")}
    assert len(set(means.values())) == 1


def test_every_configuration_of_a_trial_and_rate_gets_the_same_arrivals():
    """The seed is per trial and rate (vLLM draws the Poisson gaps from np.random): the same for
    every configuration there, different between trials and rates."""
    import numpy as np

    seeds = {(t, r): arrival_seed(0, t, r, [0.1, 0.2]) for t in (1, 2, 3) for r in (0.1, 0.2)}
    assert len(set(seeds.values())) == 6

    def gaps(seed):
        np.random.seed(seed)
        return np.random.gamma(shape=1.0, scale=1 / 0.2, size=5)

    assert np.array_equal(gaps(seeds[1, 0.2]), gaps(seeds[1, 0.2]))
    assert not np.array_equal(gaps(seeds[1, 0.2]), gaps(seeds[2, 0.2]))


def row(configuration, rate, trial, tok_s, goodput=1.0, ttft=100.0, tpot=10.0, accuracy=None):
    return {"configuration": configuration, "rate": rate, "trial": trial, "completed": 10, "failed": 0,
            "output_tok_s": tok_s, "request_goodput": goodput, "median_ttft_ms": ttft, "median_tpot_ms": tpot,
            "median_e2el_ms": 1000.0, "kv_usage_mean": 0.3, "kv_usage_peak": 0.6, "accuracy": accuracy}


def test_ratios_are_against_full_cache_of_the_same_trial_and_rate():
    rows = []
    for trial, (full, paged) in enumerate([(100, 150), (50, 75), (200, 300)], start=1):
        rows += [row("full", 0.5, trial, full), row("paged context", 0.5, trial, paged, goodput=0.5, ttft=50)]
    rows += [row("full", 1.0, 1, 10, goodput=0.0), row("paged context", 1.0, 1, 20, goodput=1.0)]
    table = {(line["configuration"], line["rate"]): line for line in rate_table(rows)}
    paged = table["paged context", 0.5]
    # a machine twice as slow in trial 2 changes no ratio: 1.5x in every trial, an interval of width 0
    assert paged["output_tok_s_ratio"] == pytest.approx(1.5) and paged["output_tok_s_low"] == pytest.approx(1.5)
    assert paged["request_goodput_ratio"] == pytest.approx(0.5) and paged["median_ttft_ms_ratio"] == pytest.approx(0.5)
    one = table["paged context", 1.0]
    assert one["output_tok_s_ratio"] == pytest.approx(2.0) and one["output_tok_s_low"] is None  # one trial
    assert one["request_goodput_ratio"] is None  # full cache's goodput 0: no ratio to take
    text = markdown(rate_table(rows), [], {"workload": "w", "command": "c", "description": "d", "model": "m",
                                            "pool_blocks": 100, "block_size": 32, "ignore_eos": False,
                                            "goodput": {"ttft": 5000.0, "tpot": 250.0}, "ratio": 0.5,
                                            "trials": 3})
    assert "1.50x (1.50-1.50)" in text and "undecided (0 in a trial)" in text and "TTFT <= 5000 ms" in text


def test_ratio_intervals_widen_with_spread_and_refuse_zero():
    cell = ratio_cell([1.2, 1.5, 1.8])
    assert cell["low"] < cell["estimate"] < cell["high"]
    assert cell["estimate"] == pytest.approx(math.exp(sum(map(math.log, [1.2, 1.5, 1.8])) / 3))
    assert ratio_cell([1.0, 0.0, 2.0])["estimate"] is None


def test_accuracy_is_paired_with_full_cache_over_whole_contexts():
    requests = []
    for configuration, right in (("full", 1.0), ("paged context", 0.0)):
        for context in ("codes-0", "births-1", "codes-2", "births-3"):
            for question in range(2):
                for trial in (1, 2, 3):
                    score = right if question == 0 else 1.0  # paged loses each context's first question
                    requests.append({"configuration": configuration, "context": context, "question": question,
                                     "score": score, "trial": trial})
    table = {line["configuration"]: line for line in accuracy_table(requests)}
    assert table["full"]["score"] == pytest.approx(100.0) and table["full"]["requests"] == 8
    assert table["paged context"]["score"] == pytest.approx(50.0)
    assert table["paged context"]["vs_full"] == pytest.approx(-50.0)
    assert "vs_full" not in table["full"]
    # the accuracy section states the smallest p its 4 contexts can reach, by the test it uses: 1/17
    text = markdown([], list(table.values()), {"workload": "w", "command": "c", "description": "d", "model": "m",
                                               "pool_blocks": 100, "block_size": 32, "ignore_eos": False,
                                               "goodput": {"ttft": 5000.0, "tpot": 250.0}, "ratio": 0.5,
                                               "trials": 3, "contexts": 4})
    assert "With 4 contexts the smallest two-sided p the test over whole contexts can reach is 0.059" in text
    # 4 contexts cannot reach p < 0.05: the comparison enters no verdict
    assert table["paged context"]["verdict"] == "no verdict"


def test_the_plan_sizes_a_design_that_can_show_non_inferiority_from_the_per_context_spread():
    """Per-context mean differences of +-10 points over four contexts of one kind: S = 11.547 points
    (ddof 1), so ((z_0.975 + z_0.8) x 11.547 / 5)^2 = 41.9 -> 42 contexts per kind; where no context
    differs, or a kind has one context, there is no spread to plan from."""
    from harness.serving.summary import contexts_for_non_inferiority

    paired = {(f"registers-{k}", q): (0.1 if k % 2 else -0.1) for k in range(4) for q in range(2)}
    assert contexts_for_non_inferiority(paired) == 42
    assert contexts_for_non_inferiority({key: 0.0 for key in paired}) is None
    assert contexts_for_non_inferiority({**paired, ("codes-0", 0): 0.2}) is None  # one context of that kind
    # a tiny spread is floored at the exact test's minimum: 6 contexts reach p < 0.025 at best
    assert contexts_for_non_inferiority({(f"registers-{k}", 0): 0.001 * (k % 2) for k in range(4)}) == 6
    table = {line["configuration"]: line for line in accuracy_table(served({"paged context": [0.1, -0.1]}))}
    assert table["paged context"]["contexts_to_show_non_inferior"] == 36  # eight contexts: S = 10.69, 35.9


def served(losses: dict[str, list[float]], contexts: int = 8) -> list[dict]:
    """Each configuration's requests (2 per context): full cache scores 0.6 on every one; a
    configuration scores 0.6 minus its loss on context k (losses cycled over the contexts)."""
    requests = []
    for configuration, loss in {"full": [0.0], **losses}.items():
        for k in range(contexts):
            for question in range(2):
                requests.append({"configuration": configuration, "context": f"registers-{k}", "question": question,
                                 "score": 0.6 - loss[k % len(loss)], "trial": 1})
    return requests


def test_accuracy_verdicts_at_the_margin_stated_before_the_run():
    """Over 8 contexts (smallest p 1/257), Holm over the family: a loss of 1-3 points is non-inferior
    at the 5-point margin, a loss of 20 is worse, a loss that straddles the margin is inconclusive."""
    table = {line["configuration"]: line for line in accuracy_table(served({
        "paged context": [0.01, 0.03, 0.02, 0.01], "streaming context": [0.2, 0.22, 0.18, 0.2],
        "snapkv context": [0.0, 0.12, -0.04, 0.08]}))}
    assert table["streaming context"]["verdict"] == "worse" and table["streaming context"]["p_holm"] < 0.05
    # decidedly worse, by less than the margin: acceptable
    assert table["paged context"]["vs_full_low"] > -ACCURACY_MARGIN and table["paged context"]["non_inferior"]
    assert not table["streaming context"]["non_inferior"]
    assert table["snapkv context"]["verdict"] == "inconclusive" and not table["snapkv context"]["non_inferior"]


def test_the_headline_names_what_reaches_the_target_at_acceptable_accuracy():
    accuracy = [{"configuration": "full"},
                {"configuration": "paged context", "verdict": "non-inferior", "non_inferior": True},
                {"configuration": "streaming context", "verdict": "worse", "non_inferior": False}]
    line = {"rate": 2.0, "request_goodput_ratio": 1.5, "request_goodput_low": 1.35, "request_goodput_high": 1.7,
            "output_tok_s_ratio": 1.4, "output_tok_s_low": 1.3, "output_tok_s_high": 1.5}
    table = [{"configuration": "full", "rate": 2.0}, {**line, "configuration": "paged context"},
             {**line, "configuration": "streaming context"}, {**line, "configuration": "paged context", "rate": 1.0}]
    text = "\n".join(headline(table, accuracy))
    assert "Reached by: paged context (at 2, 1 req/s)" in text
    assert "* streaming context: accuracy worse (not shown within the 5-point margin); goodput and output tok/s " \
           "against full cache's at 2 req/s 1.50x (1.35-1.70) better and 1.40x (1.30-1.50) better." in text
    accuracy[1].update(verdict="inconclusive", non_inferior=False)
    assert f"No configuration reaches {TARGET:g}x" in "\n".join(headline(table, accuracy))


def test_the_gauges_are_read_from_prometheus_text():
    text = ('# HELP vllm:kv_cache_usage_perc KV-cache usage.\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n')
    assert parse_metrics(text) == {"vllm:kv_cache_usage_perc": 0.25, "vllm:num_requests_running": 5.0}
    summary = gauge_summary([{"vllm:kv_cache_usage_perc": 0.2}, {"vllm:kv_cache_usage_perc": 0.6},
                             {"vllm:kv_cache_usage_perc": None}])
    assert summary == {"samples": 2, "mean": pytest.approx(0.4), "peak": 0.6}


def test_a_pool_block_holds_one_kv_cache_groups_layers_keys_and_values():
    from harness.config.models import EMBEDDED_PREFIX, SMOLLM2, TINY_HYBRID, resolve_model_path

    # 30 layers x (K, V) x 3 KV heads x 64 dims x 32 tokens x 4 bytes (float32)
    assert block_bytes(resolve_model_path(EMBEDDED_PREFIX + SMOLLM2), 32) == 30 * 2 * 3 * 64 * 32 * 4
    # a hybrid model's block holds one KV cache group's layers: the tiny Gemma 3's groups are two
    # layers each (vLLM's grouping: tests/unit/test_hybrid_memory.py), not all six
    assert block_bytes(resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID), 32) == 2 * 2 * 2 * 64 * 32 * 4


def test_a_bad_goodput_is_refused_by_vllms_own_check():
    with pytest.raises(ValueError):
        parse_goodput("latency:100")


def test_the_plot_draws_each_figure_with_its_interval_over_trials(tmp_path):
    """Each plotted figure carries half its 95% t-interval over trials (t with n-1 df), None for
    one trial; the plot is written from them."""
    from harness.serving.summary import PLOTTED, error_bars, half_width, plot

    assert half_width([10.0, 12.0, 14.0]) == pytest.approx(4.303 * 2.0 / 3 ** 0.5, rel=1e-3)
    assert half_width([10.0]) is None
    rows = [{"configuration": c, "rate": r, "trial": t, "completed": 4, "failed": 0, "output_tok_s": 10.0 + t,
             "request_goodput": 0.1 * t, "median_ttft_ms": 1000.0 * t, "median_tpot_ms": 100.0,
             "median_e2el_ms": 2000.0 * t, "kv_usage_mean": 0.5, "kv_usage_peak": 0.9, "accuracy": 50.0}
            for c in ("full", "paged context") for r in (0.1, 0.2) for t in (1, 2, 3)]
    table = rate_table(rows)
    assert all(line[f"{key}_half"] is not None for line in table for key in PLOTTED)
    assert table[0]["output_tok_s_half"] == pytest.approx(4.303 / 3 ** 0.5, rel=1e-3)      # 11, 12, 13
    assert table[0]["median_ttft_ms_half"] == pytest.approx(4.303 * 1000 / 3 ** 0.5, rel=1e-3)  # 1, 2, 3 s
    plot(table, tmp_path / "pareto.png", "w")
    assert (tmp_path / "pareto.png").stat().st_size > 10_000
    # a latency's interval over three trials can cross zero: its bar stops there
    assert error_bars([2.0, 0.5], [1.0, 1.5]) == [[1.0, 0.5], [1.0, 1.5]]
    assert error_bars([2.0, 0.5], [1.0, None]) is None


# --- where a step's time goes: the runs' saved ledgers (GET /kv_eviction/state) ----------------------

def saved_state(steps: int, model_s: float, capture_s: float, evict_s: float, reconstruct_s: float = 0.0,
                reconstruct_tokens: int = 0) -> dict:
    """What the route answers and the sweep saves as ``.ledger.json``: the scheduler's own ledger
    (``Ledger.snapshot``, the class the engine runs) with these figures, through JSON."""
    import json

    from harness.engine.scheduler import Ledger

    ledger = Ledger("paged", steps=steps, model_s=model_s, capture_s=capture_s, evict_s=evict_s,
                    reconstruct_s=reconstruct_s, reconstruct_tokens=reconstruct_tokens)
    return json.loads(json.dumps({"settings": None, "ledger": ledger.snapshot(), "free_blocks": 100,
                                  "prefix_caching": True, "requests": {}}))


def ledger_rows(paged: dict, full: dict | None = None, tok_s: float = 11.0, duration: float = 10.0) -> list[dict]:
    """Three trials at two rates of full cache (10 tok/s, its ledger ``full``) and paged context
    (``tok_s``, its ledger ``paged``), each run ``duration`` s, the rows as ``run_row`` makes them."""
    from harness.serving.bench import ledger_figures

    full = full or saved_state(400, 0.0, 0.0, 0.0)  # no evicting request: the worker timed no step
    return [{**row(name, rate, trial, 10.0 if name == "full" else tok_s), "duration_s": duration,
             **ledger_figures(full if name == "full" else paged)}
            for trial in (1, 2, 3) for rate in (0.5, 1.0) for name in ("full", "paged context")]


def test_the_split_divides_each_runs_wall_time_by_the_ledgers_parts():
    """model_s holds capture_s and evict_s holds reconstruct_s (Ledger): each part is shown without
    what it holds, and the rest of the benchmark's duration is scheduling and other."""
    from harness.serving.summary import time_split

    rows = ledger_rows(saved_state(100, model_s=6.0, capture_s=1.0, evict_s=2.0))
    split = {line["configuration"]: line for line in time_split(rows)}
    paged, full = split["paged context"], split["full"]
    assert paged["rate"] == 1.0 and paged["trials"] == 3 and paged["steps"] == 100 and paged["timed"]
    assert paged["wall_ms_per_step"] == pytest.approx(100.0)  # 10 s over 100 steps
    for key, ms in (("model", 50.0), ("capture", 10.0), ("eviction", 20.0), ("reconstruction", 0.0), ("other", 20.0)):
        assert paged[f"{key}_ms_per_step"] == pytest.approx(ms), key
        assert paged[f"{key}_share"] == pytest.approx(ms / 100.0), key
    assert sum(paged[f"{key}_share"] for key in ("model", "capture", "eviction", "reconstruction", "other")) \
        == pytest.approx(1.0)
    assert paged["eviction_work_share"] == pytest.approx(0.3) and paged["eviction_work_share_half"] == pytest.approx(0)
    assert not paged["reconstructs"]
    # full cache: no step timed, its steps and wall time per step only
    assert not full["timed"] and full["steps"] == 400 and full["wall_ms_per_step"] == pytest.approx(25.0)
    assert "model_share" not in full
    # reconstruction split out of the eviction where a policy reconstructed
    kvzip = {line["configuration"]: line for line in time_split(
        ledger_rows(saved_state(100, 6.0, 1.0, 2.0, reconstruct_s=1.5, reconstruct_tokens=300)))}["paged context"]
    assert kvzip["reconstructs"] and kvzip["eviction_ms_per_step"] == pytest.approx(5.0)
    assert kvzip["reconstruction_ms_per_step"] == pytest.approx(15.0) and kvzip["eviction_work_share"] == pytest.approx(0.3)


def test_the_split_section_says_what_would_reach_the_target_from_its_numbers():
    """At 1.1x full cache's output tok/s, 1.3x needs the run 1 - 1.1/1.3 = 15% shorter: the eviction's
    own 30% would cover it; at 0.8x it needs 38%, more than 30%. An accuracy not shown within the
    margin is named. The section is rebuilt from the rows alone, and only where ledgers were kept."""
    from harness.serving.summary import split_section, time_split

    accuracy = [{"configuration": "full"},
                {"configuration": "paged context", "verdict": "worse", "non_inferior": False}]
    state = saved_state(100, model_s=6.0, capture_s=1.0, evict_s=2.0)
    rows = ledger_rows(state, tok_s=11.0)
    text = "\n".join(split_section(time_split(rows), rate_table(rows), accuracy))
    assert text.startswith("## Where a step's time goes") and "At the highest rate (1 req/s)" in text
    assert "| configuration | trials | steps | wall ms/step | model | attention (query capture) | eviction | " \
           "scheduling and other |" in text  # no reconstruction column where nothing reconstructed
    assert "| paged context | 3 | 100 | 100.0 ± 0.0 | 50.0 (50% ± 0) | 10.0 (10% ± 0) | 20.0 (20% ± 0) | " \
           "20.0 (20% ± 0) |" in text
    assert "| full | 3 | 400 | 25.0 ± 0.0 | not timed | not timed | not timed | not timed |" in text
    assert ("* paged context: the eviction's own work (query capture, eviction) takes 30% of the wall time, the "
            "model 50%, scheduling and other 20%. Its output tok/s is 1.10x (1.10-1.10) full cache's: 1.3x at the "
            "same output tokens needs the run 15% shorter, which its eviction's own 30% would cover were it free. "
            "Its goodput against full cache's is 1.00x (1.00-1.00). Its accuracy is not shown within the 5-point "
            "margin (worse), which no time saved changes.") in text
    slower = "\n".join(split_section(time_split(ledger_rows(state, tok_s=8.0)), rate_table(ledger_rows(state, tok_s=8.0)),
                                     accuracy[:1]))
    assert ("needs the run 38% shorter, more than its eviction's own 30%: the rest would have to come off the "
            "model's 50% or the other 20%.") in slower and "Its accuracy" not in slower
    faster = "\n".join(split_section(time_split(ledger_rows(state, tok_s=15.0)), rate_table(ledger_rows(state, tok_s=15.0)),
                                     accuracy))
    assert "Its output tok/s is already 1.50x (1.50-1.50) full cache's" in faster
    # in summary.md after the verdict; a sweep saved without ledgers has no section and the same text
    settings = {"workload": "w", "command": "c", "description": "d", "model": "m", "pool_blocks": 10, "block_size": 32,
                "ignore_eos": False, "goodput": {"ttft": 5000.0}, "ratio": 0.5, "trials": 3}
    table = rate_table(rows)
    with_split = markdown(table, [], settings, None, time_split(rows))
    assert with_split.index("## Verdict") < with_split.index("## Where a step's time goes") < with_split.index("## Every rate")
    bare = [{key: value for key, value in r.items() if not key.startswith("ledger_")} for r in rows]
    assert time_split(bare) == [] and markdown(rate_table(bare), [], settings, None, time_split(bare)) \
        == markdown(table, [], settings, None)


def test_a_runs_ledger_is_saved_beside_it_and_read_into_its_row(tmp_path):
    """``write_run`` keeps the route's answer as ``.ledger.json``; a run without one (a server
    without the eviction scheduler, or a sweep saved before) writes none and its row has no ledger figures."""
    import json

    from harness.serving.bench import LEDGER_FIGURES, ledger_figures, write_run

    state = saved_state(7, 1.0, 0.25, 0.5)
    write_run(tmp_path, "a", {"x": 1}, [], state)
    write_run(tmp_path, "b", {"x": 1}, [])
    assert json.loads((tmp_path / "runs" / "a.ledger.json").read_text()) == state
    assert not (tmp_path / "runs" / "b.ledger.json").exists()
    figures = ledger_figures(state)
    assert figures == {"ledger_steps": 7, "ledger_model_s": 1.0, "ledger_capture_s": 0.25, "ledger_evict_s": 0.5,
                       "ledger_reconstruct_s": None} and len(figures) == len(LEDGER_FIGURES)
    assert ledger_figures(None) == {}


def test_the_state_route_answers_404_without_the_eviction_scheduler():
    """The route added after vLLM's own (``harness.engine.frontend``) asks the engine core's
    ``kv_eviction_state`` utility, with ``reset``, and answers its state, or 404 where the utility
    answers None (vLLM's own scheduler). The engine client here is a stand-in that records the call:
    tests/engine/test_served_state.py asks a real ``vllm serve``."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from harness.engine.frontend import STATE_ROUTE, wrap_register_api_routers

    calls = []

    class Core:
        def __init__(self, answer):
            self.answer = answer

        async def call_utility_async(self, method, *args):
            calls.append((method, *args))
            return self.answer

    class Client:
        def __init__(self, answer):
            self.engine_core = Core(answer)

    app = FastAPI()
    wrap_register_api_routers(lambda args, app, supported_tasks, model_config: None)(None, app, ("generate",), None)
    app.state.engine_client = Client(None)
    with TestClient(app) as http:
        assert http.get(STATE_ROUTE).status_code == 404
        app.state.engine_client = Client({"ledger": {"steps": 3}})
        answer = http.get(f"{STATE_ROUTE}?reset=1")
        assert answer.status_code == 200 and answer.json() == {"ledger": {"steps": 3}}
    assert calls == [("kv_eviction_state", False, None), ("kv_eviction_state", True, None)]


# --- conversations: a run of harness.engine.bench_client.conversations --------------------------------

def conversation_run(cached: list[int], blocks: float, hits: int = 0, misses: int = 0) -> tuple[dict, dict]:
    """Two conversations of two turns as the driver saves them (conversation then turn order), later
    turns' prompts 150 tokens with ``cached`` of each found cached, and the run's ledger state."""
    saved = {"completed": 4, "failed": 0, "duration": 10.0, "output_throughput": 5.0, "request_goodput": 0.4,
             "request_throughput": 0.4, "total_output_tokens": 20, "max_concurrent_requests": 2,
             "generated_texts": ["12345", "no", "54321", "54321"], "output_lens": [5] * 4, "ttfts": [0.1] * 4,
             "latencies": [1.0] * 4, "errors": [""] * 4, "input_lens": [100, 150, 100, 150],
             "cached_tokens": [0, cached[0], 0, cached[1]], "output_token_ids": [[1]] * 4}
    state = {"ledger": {"kv_blocks_used_mean": blocks, "kv_blocks_used_peak": 2 * blocks,
                        **({"shared_contexts": {"chain_hits": hits, "chain_misses": misses}} if hits or misses else {})}}
    return saved, state


def test_a_conversation_runs_row_counts_what_later_turns_computed_and_the_chain_beside_its_twin():
    """run_row: each request's cached tokens, per run the mean tokens a later turn computed (prompt
    less cached), the ledger's mean and peak blocks and the chain's hits; the section puts each
    configuration beside full cache and a chained one beside its twin, in the same trial and rate."""
    from harness.serving.bench import run_row
    from harness.serving.summary import conversation_section
    from harness.serving.workloads import Item

    items = [Item(f"codes-{c}", t, "key_retrieval", [1] * (100 + 50 * t), 10, 16, (("12345",) if c == 0 else ("54321",)))
             for c in range(2) for t in range(2)]
    # a chained turn that takes its entry reports the turn before's prompt and all but its last
    # output token as cached (100 + 1 - 1); one of the chain's two later turns misses (block-aligned 96)
    figures = {"full": ([140, 140], 40.0), "paged context": ([96, 96], 20.0), "paged context chained": ([100, 96], 18.0)}
    rows = []
    for trial in (1, 2, 3):
        for name, (cached, blocks) in figures.items():
            # the ledger's own count (which a preempted turn taking its entry again counts twice) is not read
            saved, state = conversation_run(cached, blocks, *((5, 2) if name.endswith("chained") else (0, 0)))
            row_, requests = run_row({"configuration": name, "rate": 0.1, "trial": trial}, saved, [], items, state)
            rows.append(row_)
    assert [r["cached_tokens"] for r in requests] == [0, 100, 0, 96] and [r["score"] for r in requests] == [1, 0, 1, 1]
    assert row_["later_turn_computed"] == 52 and row_["kv_blocks_mean"] == 18.0 and row_["chain_hits"] == 1
    assert row_["later_turns"] == 2
    text = "\n".join(conversation_section(rows, "conv/s"))
    assert text.startswith("## Conversations") and "| rate (conv/s) |" in text
    assert "| 0.1 | full | 10 | - | - | 40.0 | - | - | - |" in text
    assert "| 0.1 | paged context | 54 | 5.40x (5.40-5.40) | - | 20.0 | 0.50x (0.50-0.50) | - | - |" in text
    assert ("| 0.1 | paged context chained | 52 | 5.20x (5.20-5.20) | 0.96x (0.96-0.96) | 18.0 | 0.45x (0.45-0.45) | "
            "0.90x (0.90-0.90) | 3/6 |") in text
    # a single-turn sweep's rows carry no blocks: no section, so its summary is what it was
    assert conversation_section([row("full", 0.5, 1, 10.0)], "req/s") == []


def test_the_summary_says_whether_full_cache_queues_on_the_pool():
    from harness.serving.summary import markdown, pool_clause

    settings = {"workload": "w", "command": "c", "description": "d", "model": "m", "pool_blocks": 159, "block_size": 32,
                "ignore_eos": False, "goodput": {"ttft": 5000.0}, "ratio": 0.5, "trials": 3}
    assert pool_clause(settings) == ""  # settings that do not say what full cache needs
    queues = markdown([], [], {**settings, "full_cache_blocks": 317}, None)
    assert ("a pool of 158 blocks of 32 tokens (vLLM's 159 less its null block), where full cache queues: with "
            "prefix caching it needs 317 to run every request at once)") in queues
    roomy = pool_clause({**settings, "pool_blocks": 318, "full_cache_blocks": 317})  # 317 blocks for requests
    assert roomy == ", where full cache does not queue: with prefix caching it needs 317 to run every request at once"
    # vLLM's count holds its null block: 317 of them leave 316 for requests, one short
    assert pool_clause({**settings, "pool_blocks": 317, "full_cache_blocks": 317}).startswith(", where full cache queues")
    assert "every conversation at once" in pool_clause({**settings, "full_cache_blocks": 317, "turns": 4})


def test_a_verify_replay_is_compared_with_the_committed_texts_sent_alone(tmp_path):
    """``--verify`` replays requests alone: like against like. The committed multi_turn sweep's
    chained codes-4 question 2 parted at character 0 alone against under load when it ran (its
    alone.json); replayed alone at later code it gives the committed alone text, which is equal, not
    moved. A sweep that saved no alone run falls back to the texts under load; a replay that parts
    from the committed alone text is moved, at the character where it parts."""
    import json

    from harness.serving.bench import parted_at
    from harness.serving.experiment import against_committed_alone

    committed, replay = tmp_path / "committed", tmp_path / "replay"
    for folder, texts in ((committed, ["a b", "c d"]), (replay, ["a b", "c x"])):
        (folder / "runs").mkdir(parents=True)
        (folder / "runs" / "alone-paged_context_chained.json").write_text(json.dumps({"generated_texts": texts}))
    (replay / "runs" / "alone-full.json").write_text(json.dumps({"generated_texts": ["e"]}))
    under_load = [{"configuration": "paged context chained", "context": "c", "question": 0, "equal": False,
                   "parted_at_char": 0},
                  {"configuration": "paged context chained", "context": "c", "question": 1, "equal": True,
                   "parted_at_char": None},
                  {"configuration": "full", "context": "c", "question": 0, "equal": False, "parted_at_char": 0}]
    checked = against_committed_alone(under_load, committed, replay)
    assert [(c["equal"], c["parted_at_char"], c["against"]) for c in checked] == [
        (True, None, "alone"), (False, 2, "alone"), (False, 0, "under load")]
    assert parted_at("abc", "abc") is None and parted_at("abc", "abd") == 2 and parted_at("ab", "abc") == 2


def test_every_ratio_to_full_cache_carries_its_word_and_a_bound_shows_its_side_of_one():
    """Issue 65: a served ratio gets the word every throughput summary gives (``ratio_verdict`` at
    5%, lower is better for TTFT and TPOT, no verdict without an interval); a bound of 1.003 prints
    as 1.003, not 1.00 beside better; a workload with no scored answers says it enters no
    accuracy verdict and states what its ratios' test can reach."""
    from harness.serving.summary import judged, ratio_bound, ratio_design, ratio_word

    line = {"configuration": "paged context", "output_tok_s_ratio": 1.06, "output_tok_s_low": 1.003,
            "output_tok_s_high": 1.12, "median_ttft_ms_ratio": 1.06, "median_ttft_ms_low": 1.003,
            "median_ttft_ms_high": 1.12, "request_goodput_ratio": 1.0, "request_goodput_low": 0.97,
            "request_goodput_high": 1.04, "median_tpot_ms_ratio": 0.9, "median_tpot_ms_low": None,
            "median_tpot_ms_high": None}
    assert [ratio_word(line, key) for key in ("output_tok_s", "median_ttft_ms", "request_goodput", "median_tpot_ms")] \
        == ["better", "worse", "equivalent", "no verdict"]
    assert judged(line, "output_tok_s") == "1.06x (1.003-1.12) better"
    assert judged({**line, "configuration": "full"}, "output_tok_s") == "1.00x"
    assert ratio_bound(0.9996) == "0.9996" and ratio_bound(1.0) == "1.00" and ratio_bound(1.26) == "1.26"
    assert "no accuracy verdict" in ratio_design([]) and "no accuracy verdict" not in ratio_design([{"verdict": "worse"}])
    assert "no floor above 0" in ratio_design([])

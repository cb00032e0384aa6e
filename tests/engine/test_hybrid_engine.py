"""Eviction on a hybrid-attention model in the engine (issue 66): the tiny Gemma 3 (``tiny-gemma3``:
four layers with a 32-token sliding window, two global), against stock vLLM and the plain reference
taught the window (``tests.support.plain_reference``: local layers attend over the last 32 logical
positions of what they hold, global layers over what eviction kept).

Policies act on the global layers' KV cache group; vLLM's sliding-window manager frees the local
groups' blocks as before (``harness.engine.layer_groups``). Three engines, each in a process of its own
(the engine tests' pool: ``tests.support.engine_support.run_spec``)."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from harness.config import engine_settings
from harness.config.models import EMBEDDED_PREFIX, TINY_HYBRID, TINY_HYBRID_WINDOW, resolve_model_path
from tests.support.engine_support import (BLOCK, DECODE_EVICTING_TOKENS, assert_mostly_equal, assert_same_outputs,
                                          mixed_lengths, plain_policy, run_spec)

pytestmark = pytest.mark.engine

# a block rule on K/V scores, a positional rule, and one reading the global layers' queries (the
# capture hooks beside sliding-window layers); H2O passed too when tried (issue 66), left out for CI time
POLICIES = ["paged", "streaming", "snapkv"]
BUDGET = 128
# Prompts of 100-700 tokens: past the window (32) and the budget, so local layers slide and global ones
# evict in prefill, then in decode too (DECODE_EVICTING_TOKENS).
LENGTHS = mixed_lengths(8, 100, 700, seed=1)
NEW_TOKENS = DECODE_EVICTING_TOKENS


@pytest.fixture(scope="module")
def model():
    return resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID)


@pytest.fixture(scope="module")
def prompts(model):
    from harness.tasks.embedded.token_prompts import token_prompts

    return token_prompts(model, LENGTHS, 1)


@pytest.fixture(scope="module")
def run(model, prompts, tmp_path_factory):
    """One batch per engine configuration, kept for the module: ``stock`` (vLLM without the plugin),
    ``unreached`` (PagedEviction at a budget no prompt reaches: the physical-length machinery on,
    nothing evicted) and ``evicting`` (each prompt once per policy of POLICIES at BUDGET)."""
    specs = {
        "stock": dict(stock=True),
        "unreached": dict(eviction={"policy": "paged", "budget": 2048}),
        "evicting": dict(prompts=prompts * len(POLICIES), eviction={"policy": POLICIES[0], "budget": BUDGET},
                         request_eviction=[None if policy == POLICIES[0] else {"policy": policy, "budget": BUDGET}
                                           for policy in POLICIES for _ in prompts]),
    }
    done = {}

    def get(name: str) -> dict:
        if name not in done:
            spec = {"model_path": model, "prompts": prompts, "max_new_tokens": NEW_TOKENS, "max_model_len": 4096,
                    "top_logprobs": 3, **specs[name], "engine": asdict(engine_settings())}
            done[name] = run_spec(spec, tmp_path_factory.mktemp(name), timeout_s=900)
        return done[name]

    return get


def test_full_cache_equals_stock_vllm_on_a_hybrid_model(run):
    stock, unreached = run("stock"), run("unreached")
    assert stock["ledger"] is None and unreached["ledger"]["policy"] == "paged", "plugin off / on as asked"
    # vLLM gave the model its two sliding-window groups and its global group; the scheduler took them
    assert unreached["ledger"]["kv_cache_groups"] == 3
    assert unreached["ledger"]["freed_blocks"] == 0
    assert_same_outputs(stock, unreached)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_of_the_global_layers_equals_the_plain_reference(run, model, prompts, policy):
    from tests.support.plain_reference import PlainReference

    evicting = run("evicting")
    at = POLICIES.index(policy) * len(prompts)
    outputs = evicting["outputs"][at:at + len(prompts)]
    counters = evicting["request_counters"][at:at + len(prompts)]
    assert all(c is not None and c["policy"] == policy and c["evictions"]["prefill"] == 1 for c in counters)
    assert sum(c["evictions"]["decode"] for c in counters) >= len(prompts)  # decode eviction ran too
    plain = PlainReference(model)
    expected = [plain.generate(prompt, NEW_TOKENS, plain_policy(policy, BUDGET))[0] for prompt in prompts]
    assert_mostly_equal(outputs, expected)
    # and eviction changed what the model generates (the check could fail)
    assert sum(o != s for o, s in zip(outputs, run("stock")["outputs"])) >= len(prompts) // 2


def test_blocks_are_freed_in_the_global_group_only_and_vllm_frees_the_windows(run):
    ledger = run("evicting")["ledger"]
    sliding_first, sliding_second, global_group = ledger["evicting_group_blocks_peak"]
    # a local group holds the window and the newest block (vllm/v1/kv_cache_interface.py:859-885)
    assert sliding_first == sliding_second == -(-(TINY_HYBRID_WINDOW - 1) // BLOCK) + 1
    assert global_group == BUDGET // BLOCK + 1  # the budget and the block decode fills past it
    assert ledger["freed_blocks"] > 0
    assert run("evicting")["free_blocks_after"] == ledger["kv_pool_blocks"]  # every block came back

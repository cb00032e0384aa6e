"""The eviction engine inside vLLM 0.32 against stock vLLM and the Hugging Face reference.

Every engine runs in a process of its own (harness.engine.batch_run's batches, on the engine tests'
kept engines: tests/support/engine_pool.py); the reference runs here. The
policies share one engine per model (``every_policy``): each is checked on its own requests, by
their outputs and their own eviction counters (batch_run's request_counters).
"""
from __future__ import annotations

import math

import pytest

from harness.eviction.counters import EvictionCounters
from policies import make_policy
from tests.support.engine_support import (
    BLOCK, DECODE_EVICTING_TOKENS, assert_mostly_equal, assert_same_outputs, mixed_lengths, reference_outputs, run_engine,
    text_prompts,
)

pytestmark = pytest.mark.engine

POLICIES = ["paged", "streaming", "knorm", "keydiff"]
# Prompts of 600-1500 tokens with budgets well below them: eviction in prefill, then decode
# eviction too (asserted per policy; test_prefix_caching generates 80 tokens, two of them).
# The tiny model's twenty cover the mix of lengths against the Hugging Face reference (the
# plumbing's oracle). SmolLM2 is not run here (CI time: its engine and four references took about a
# minute): tests/engine/test_policy_matrix.py runs these four policies, and every other registered
# one, on SmolLM2 in the engine against the plain reference (the semantics' oracle), which
# tests/unit/test_plain_reference.py holds equal to the Hugging Face reference.
CASES = {"tiny": dict(prompts=20, budget=128)}
NEW_TOKENS = DECODE_EVICTING_TOKENS


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("engines")


def every_policy(workdir, model: str, count: int | None = None, **spec) -> tuple[list[list[int]], dict]:
    """One engine for every policy of POLICIES: each prompt (the model's first ``count``, or all)
    once per policy in one batch, the policies one after another; ``paged`` is the engine's default
    (additional_config), the others are each request's own settings (extra_args)."""
    case = CASES[model]
    prompts = text_prompts(model, mixed_lengths(case["prompts"], 600, 1500, seed=2), seed=2)[:count]
    default = {"policy": POLICIES[0], "budget": case["budget"]}
    settings = [None if policy == default["policy"] else {"policy": policy, "budget": case["budget"]}
                for policy in POLICIES for _ in prompts]
    return prompts, run_engine(workdir, model, prompts * len(POLICIES), NEW_TOKENS, eviction=default,
                               request_eviction=settings, **spec)


def of_policy(run: dict, policy: str, count: int) -> tuple[list[list[int]], list[dict | None]]:
    """A policy's requests in an ``every_policy`` run: their outputs and eviction counters."""
    at = POLICIES.index(policy) * count
    return run["outputs"][at:at + count], run["request_counters"][at:at + count]


@pytest.fixture(scope="module")
def policy_runs(workdir):
    """Each model: the prompts, its ``every_policy`` run, and (per policy, computed once) the
    reference's outputs."""
    runs, references = {}, {}

    def get(model: str, policy: str):
        if model not in runs:
            runs[model] = every_policy(workdir, model)
        prompts, engine = runs[model]
        if (model, policy) not in references:
            references[model, policy] = reference_outputs(model, make_policy(policy, CASES[model]["budget"], BLOCK),
                                                          prompts, NEW_TOKENS)
        return prompts, engine, references[model, policy]

    return get


@pytest.mark.parametrize("model", list(CASES))
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_equals_reference(policy_runs, model, policy):
    prompts, engine, reference = policy_runs(model, policy)
    outputs, counters = of_policy(engine, policy, len(prompts))
    assert all(c is not None and (c["policy"], c["budget"]) == (policy, CASES[model]["budget"]) for c in counters), \
        "each request evicted with its own policy and budget"
    assert EvictionCounters.over(engine["request_counters"]).evictions == engine["ledger"]["evictions"], \
        "the requests' counters are the engine's"
    assert_mostly_equal(outputs, reference)
    evictions = EvictionCounters.over(counters).evictions
    assert evictions["prefill"] == len(prompts), "every prompt was pruned after prefill"
    assert evictions["decode"] >= len(prompts), "and evicted again while decoding"


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_is_really_returned(policy_runs, policy):
    prompts, engine, _ = policy_runs("tiny", policy)
    budget = CASES["tiny"]["budget"]
    ledger = engine["ledger"]
    # The engine's figures cover every policy's requests, all at one budget, all attention-free.
    assert ledger["capture_s"] == 0, "no query is captured for attention-free policies"
    assert ledger["decode_blocks_peak"] <= math.ceil((budget + BLOCK) / BLOCK) + 1
    assert engine["free_blocks_after"] == engine["free_blocks_before"] == ledger["kv_pool_blocks"], "every block is back"
    counters = EvictionCounters.over(of_policy(engine, policy, len(prompts))[1])
    assert counters.freed_blocks > 0
    copied = counters.copied_tokens
    assert copied["prefill"] > 0, "prompt compaction copies the kept tokens into the first slots"
    if policy == "paged":
        assert copied["decode"] == 0, "a block policy drops whole blocks in decode: no copies"
    else:
        assert copied["decode"] > 0, "token policies pay compaction copies in decode"


# Two of the tiny model's prompts per policy cross the boundary (CI time: an engine core in its own
# process cannot be kept between tests, and 80 requests took 55 s): every policy, the default and
# per-request settings, each request evicting in prefill and decode (asserted below), against the
# same requests' rows of the in-process batch. tests/engine/test_trust.py checks run.py's ledger
# through the same boundary (one PagedEviction sample), not the outputs.
OWN_PROCESS_PROMPTS = 2


def test_engine_core_in_its_own_process_gives_the_same_outputs(policy_runs, workdir):
    """The plugin patches every vLLM process: scheduler and worker in their own processes agree
    with the in-process engine on the same requests, run concurrently (every policy, the engine's
    default and per-request settings)."""
    prompts, in_process, _ = policy_runs("tiny", "paged")
    _, separate = every_policy(workdir, "tiny", OWN_PROCESS_PROMPTS, in_process=False)
    rows = [POLICIES.index(policy) * len(prompts) + index for policy in POLICIES for index in range(OWN_PROCESS_PROMPTS)]
    same = {key: [in_process[key][row] for row in rows] for key in ("outputs", "top_logprobs", "request_counters")}
    assert_same_outputs(same, separate)
    # The ledger and each request's counters come back through an engine-core utility call when
    # the core is in another process: the same as the in-process engine counted for these requests.
    counted = EvictionCounters.over(same["request_counters"])
    assert separate["ledger"]["evictions"] == counted.evictions
    assert counted.evictions["prefill"] == len(rows) and counted.evictions["decode"] >= len(rows)
    assert separate["ledger"]["freed_blocks"] == EvictionCounters.over(separate["request_counters"]).freed_blocks \
        == counted.freed_blocks > 0
    assert [c and (c["policy"], c["evictions"]) for c in separate["request_counters"]] == \
        [c and (c["policy"], c["evictions"]) for c in same["request_counters"]]
    assert separate["free_blocks_after"] == separate["ledger"]["kv_pool_blocks"]


# Last, and the tiny model last: its engine without eviction is the first the next file asks for
# (tests/engine/test_engine_tensor_parallel.py: one engine start fewer, tests/support/engine_pool.py).
@pytest.mark.parametrize("model", ["smollm2", "tiny"])
def test_full_cache_equals_stock_vllm(workdir, model):
    """20 prompts of mixed lengths (6 on SmolLM2, 145-1181 tokens; 12 before, CI time: two SmolLM2
    engines prefill them): stock vLLM, the patched engine with eviction off, and with a budget no
    prompt reaches (the physical-length machinery active, nothing evicted) agree token for token (up
    to fp32 rounding ties, see assert_same_outputs)."""
    prompts = text_prompts(model, mixed_lengths(20 if model == "tiny" else 6, 16, 1500, seed=1), seed=1)
    stock = run_engine(workdir, model, prompts, 32, stock=True)
    patched = run_engine(workdir, model, prompts, 32, eviction={"policy": "paged", "budget": 2048})
    assert patched["ledger"]["policy"] == "paged" and stock["ledger"] is None, "plugin on / off as asked"
    assert patched["ledger"]["freed_blocks"] == 0
    assert_same_outputs(stock, patched)
    if model == "tiny":
        off = run_engine(workdir, model, prompts, 32)
        assert off["ledger"]["policy"] is None
        assert_same_outputs(stock, off)

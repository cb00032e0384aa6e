"""Budgets as compression ratios and prompt-only compression (kvpress's setting) in the real
engine: each request's ratio becomes (1 - r) x its prompt, rounded to blocks, and
``decode_eviction: false`` evicts after prefill only. One SmolLM2 engine runs every case in one
batch through per-request settings; each equals the plain reference (no code shared with
policies/ or harness/engine/) run at the budget the ratio gives, decode eviction on or off."""
from __future__ import annotations

import pytest

from harness.eviction.settings import budget_for_ratio
from tests.support.engine_support import BLOCK, DECODE_EVICTING_TOKENS, assert_mostly_equal, mixed_lengths, model_path, plain_policy, run_engine, text_prompts

pytestmark = pytest.mark.engine

# The cases with decode eviction on evict in decode too (asserted per case).
NEW_TOKENS = DECODE_EVICTING_TOKENS
# (policy, ratio, decode eviction): token and block granularity, attention-free and attention-aware.
CASES = [("knorm", 0.5, True), ("paged", 0.75, True), ("snapkv", 0.5, False), ("paged", 0.5, False)]


@pytest.fixture(scope="module")
def prompts():
    """Two prompts of 500-900 tokens: every ratio here evicts them after prefill."""
    return text_prompts("smollm2", mixed_lengths(2, 500, 900, seed=5), seed=5)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, prompts):
    settings = [{"policy": name, "budget": None, "budget_ratio": ratio, "decode_eviction": decode}
                for name, ratio, decode in CASES for _ in prompts]
    return run_engine(tmp_path_factory.mktemp("ratio"), "smollm2", prompts * len(CASES), NEW_TOKENS,
                      request_eviction=settings)


@pytest.fixture(scope="module")
def plain_runs(prompts):
    from tests.support.plain_reference import PlainReference

    plain = PlainReference(model_path("smollm2"))
    runs = []
    for name, ratio, decode in CASES:
        for prompt in prompts:
            policy = plain_policy(name, budget_for_ratio(ratio, len(prompt), BLOCK), BLOCK)
            policy.decode_eviction = decode
            runs.append(plain.generate(prompt, NEW_TOKENS, policy))
    return runs


def test_each_ratio_runs_at_its_prompts_budget_and_prompt_only_never_evicts_in_decode(engine_run, plain_runs, prompts):
    assert_mostly_equal(engine_run["outputs"], [ids for ids, _ in plain_runs])
    ledger = engine_run["ledger"]
    assert ledger["evictions"]["prefill"] == len(CASES) * len(prompts)
    assert ledger["evictions"]["decode"] == sum(counts["decode"] for _, counts in plain_runs) > 0
    for index, (name, ratio, decode) in enumerate(CASES):
        for offset in range(len(prompts)):
            counts = plain_runs[index * len(prompts) + offset][1]
            assert counts["prefill"] == 1 and (counts["decode"] > 0) == decode, (name, ratio, decode, counts)
    assert engine_run["free_blocks_after"] == engine_run["free_blocks_before"] == ledger["kv_pool_blocks"]


def test_a_ratio_keeps_its_share_of_the_prompt_in_whole_blocks():
    assert budget_for_ratio(0.5, 1000, 32) == 512       # 500 tokens: 15.6 blocks, rounded to 16
    assert budget_for_ratio(0.75, 1000, 32) == 256      # 250 tokens: 7.8 blocks -> 8
    assert budget_for_ratio(0.9, 300, 32) == 64         # 30 tokens: below two blocks -> the minimum
    assert budget_for_ratio(0.0, 640, 32) == 640        # nothing removed

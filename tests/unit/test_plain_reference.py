"""The plain references (tests/support/plain_reference.py, no shared code) agree with the harness's
Hugging Face reference engine, which runs the harness's own evictor and policies."""
from __future__ import annotations

import pytest

import torch

from harness.eviction.evictor import evict
from harness.eviction.settings import EvictionSettings, build_policy
from harness.eviction.state import PolicyState
from harness.engine.backend_views import FlashAttnView
from policies import make_policy
from tests.support.engine_support import BLOCK, model_path, plain_policy, text_prompts
from tests.support.plain_reference import PlainReference
from tests.support.policy_matrix import MATRIX, MATRIX_IDS, model_cases
from tests.support.policy_probe import assert_pool_holds


def test_the_plain_reference_imports_no_harness_code():
    from pathlib import Path

    from tests.support import plain_reference

    lines = Path(plain_reference.__file__).read_text().splitlines()
    imports = [line.strip() for line in lines if line.strip().startswith(("import ", "from "))]
    assert imports and not [line for line in imports if "policies" in line or "harness" in line], imports


@pytest.fixture(scope="module")
def plain():
    return PlainReference(model_path("tiny"))


@pytest.mark.parametrize("block", [BLOCK, 16], ids=["cpu_block", "gpu_block"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_the_evictor_keeps_what_the_plain_rule_keeps(name, options, phase, block):
    """Random K/V of 3 layers x 2 KV heads (4 query heads, a window of 32 random queries): after one
    eviction the harness's evictor left in the request's slots exactly the K/V the plain rule keeps,
    at the CPU's 32-token blocks and the GPU's 16 (where SnapKV's window spans two blocks)."""
    kept = evict_as_both(name, options, phase, block, make_policy(name, 64, block, **options))
    if phase == "prefill":  # 100 tokens: a block rule keeps 100 mod block beside its budget of 64
        assert kept == 64 + (100 % block if make_policy(name, 64, block, **options).granularity == "block" else 0)


@pytest.mark.parametrize("block", [BLOCK, 16], ids=["cpu_block", "gpu_block"])
@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_compressing_a_context_the_evictor_keeps_what_the_plain_rule_keeps(name, options, block):
    """The same, the 100 tokens a context compressed alone (``compress=context``): the policy the engine
    builds for it (``build_policy``) and the plain rule's context compression keep the budget exactly,
    whole blocks, at both granularities (a block rule's 100 mod block tokens no more), the same K/V."""
    settings = EvictionSettings(name, 64, dict(options), decode_eviction=False, compress="context")
    assert evict_as_both(name, options, "prefill", block, build_policy(settings, block), whole_blocks=True) == 64


def evict_as_both(name: str, options: dict, phase: str, block: int, policy, whole_blocks: bool = False,
                  budget: int = 64, prompt: int = 100, protect_prefix: int = 0) -> int | None:
    """One eviction by the harness's evictor (``policy``, at ``budget``) and by the plain rule on the
    same random K/V (``prompt`` tokens in prefill); asserts both kept the same K/V (or dropped the
    same block), and the first ``protect_prefix`` tokens among them; the tokens kept (None where a
    block was dropped)."""
    layers, heads, dim = 3, 2, 8
    tokens = prompt if phase == "prefill" else budget + block
    gen = torch.Generator().manual_seed(len(name) + tokens)
    pool = max(8, -(-tokens // block) + 1)  # blocks in the pool
    view = FlashAttnView([torch.randn(pool, heads, block, 2 * dim, generator=gen) for _ in range(layers)])
    blocks = list(range(-(-tokens // block)))
    keys = [view.read_layer(l, blocks, 0, tokens)[0].permute(1, 0, 2) for l in range(layers)]
    values = [view.read_layer(l, blocks, 0, tokens)[1].permute(1, 0, 2) for l in range(layers)]
    queries = torch.randn(layers, 32, 2 * heads, dim, generator=gen)
    state = PolicyState(scales=[0.3] * layers)
    if policy.query_window:
        state.observe("r", queries, policy.query_window)
    eviction = evict(policy, view, blocks, tokens, phase, state, "r")

    rule = plain_policy(name, budget, block, options.get("granularity"))
    rule.protect_prefix = protect_prefix
    if rule.counts_queries:
        rule.count(keys, list(queries), 0.3)
    kept = rule.keep(keys, values, phase, list(queries), 0.3, whole_blocks)
    if isinstance(kept, int):  # a whole block left: the block list lost it, nothing moved
        assert eviction.dropped_blocks == (kept,)
        assert kept * block >= protect_prefix, "no block holding a protected token leaves"
        return None
    assert_pool_holds(view, blocks, eviction.kept_blocks, kept, keys, values)
    assert (kept[..., :protect_prefix] == torch.arange(protect_prefix)).all(), "the protected prefix stays"
    return kept.shape[-1]


@pytest.mark.parametrize("block", [BLOCK, 16], ids=["cpu_block", "gpu_block"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_with_a_protected_prefix_the_evictor_keeps_what_the_plain_rule_keeps(name, options, phase, block):
    """The same with ``protect_prefix=50`` (past a 32-token block, and three 16-token blocks and part of a
    fourth), budget 128 and a 200-token prompt: the policy the engine builds for the setting
    (``build_policy``) and the plain rule, which protects the tokens at logical positions below 50 by
    its own rule, keep the same K/V, the prefix among it, counted inside the budget."""
    settings = EvictionSettings(name, 128, dict(options), protect_prefix=50)
    policy = build_policy(settings, block)
    kept = evict_as_both(name, options, phase, block, policy, budget=128, prompt=200, protect_prefix=50)
    if phase == "prefill":
        assert kept == 128 + (200 % block if policy.granularity == "block" else 0)


# 40 new tokens at budget 128 and block 32: every rule's cache reaches C + B = 160 in decode (a token
# rule holds 128 after the prefill and gets there after 32 decode passes, a block rule holds 136 or 156
# and sooner), so each prompt sees a decode eviction and outputs generated after it; each prompt's
# final cache, compared layer by layer, then shows both references kept the same K/V after it.
NEW_TOKENS = 40


@pytest.mark.parametrize("name, options", model_cases())  # all but two cases slow
def test_plain_rule_equals_the_harness_reference(plain, name, options):
    from harness.eviction.hf_reference import HFReferenceEngine

    prompts = text_prompts("tiny", [700, 1000], seed=2)
    rule = plain_policy(name, 128, BLOCK, options.get("granularity"))
    engine = HFReferenceEngine(model_path("tiny"), make_policy(name, 128, BLOCK, **options))
    for prompt in prompts:
        ids, counts = plain.generate(prompt, NEW_TOKENS, rule)
        assert counts["prefill"] == 1 and counts["decode"] >= 1, "both phases evict"
        assert ids == engine.generate(prompt, NEW_TOKENS)
        for mine, theirs in zip(plain.cache.layers, engine.cache.layers, strict=True):
            torch.testing.assert_close(theirs.keys, mine.keys, rtol=0, atol=0)
            torch.testing.assert_close(theirs.values, mine.values, rtol=0, atol=0)

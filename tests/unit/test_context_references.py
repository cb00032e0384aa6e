"""Query-agnostic compression (``compress=context``, kvpress's leaderboard setting) in the two
references: the prompt's first ``context_tokens`` tokens are prefilled and evicted as if they were
the prompt, the question is prefilled on top of what stayed (logical RoPE positions), and nothing is
evicted after. The plain reference (no shared code) and the Hugging Face reference (the harness's
evictor) must agree on every registered policy."""
from __future__ import annotations

import pytest
import torch

from harness.eviction.hf_reference import HFReferenceEngine
from policies import make_policy
from tests.support.engine_support import BLOCK, model_path, plain_policy, text_prompts
from tests.support.plain_reference import PlainPolicy, PlainReference
from tests.support.policy_matrix import model_cases

PROMPT_TOKENS = 300
CONTEXT = 210                          # 70% of the prompt is context, the rest the question
BUDGET = CONTEXT // 2 // BLOCK * BLOCK  # half the context in whole blocks (96), as a ratio of 0.5 resolves
NEW_TOKENS = 24
# The matrix test's outputs: after the question nothing is evicted, so each reference's final cache
# (compared bit for bit, every layer) holds all that the later tokens would be computed from.
MATRIX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompt():
    return text_prompts("tiny", [PROMPT_TOKENS], seed=7)[0]


@pytest.fixture(scope="module")
def plain():
    return PlainReference(model_path("tiny"))


def compressing(name: str, options: dict):
    """The harness's policy as the engine builds it for compress=context (whole blocks kept:
    ``build_policy``), and the plain rule, both compressing the context only."""
    policy = make_policy(name, BUDGET, BLOCK, **options)
    policy.decode_eviction, policy.whole_blocks = False, True
    rule = plain_policy(name, BUDGET, BLOCK, options.get("granularity"))
    rule.decode_eviction = False
    return policy, rule


class Passes:
    """Records each forward pass a reference runs: (first logical position, first physical cache
    slot, tokens), so a test sees where the question landed after the context's eviction."""

    def __init__(self, model):
        self.seen: list[tuple[int, int, int]] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        self.seen.append((int(kwargs["position_ids"][0, 0]), int(kwargs["cache_position"][0]),
                          kwargs["input_ids"].shape[1]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("name, options", model_cases())  # all but two cases slow
def test_context_compression_plain_rule_equals_the_harness_reference(plain, prompt, name, options):
    """Token for token, and both references put the question at logical position CONTEXT, right
    after the budget's whole blocks (the context's eviction was the prefill eviction, and the only
    one), and end holding the same K/V in every layer (the context's kept tokens, the question's and
    the outputs', bit for bit)."""
    policy, rule = compressing(name, options)
    engine = HFReferenceEngine(model_path("tiny"), policy)
    with Passes(plain.model) as plain_passes:
        ours, counts = plain.generate(prompt, MATRIX_NEW_TOKENS, rule, context_tokens=CONTEXT)
    with Passes(engine.model) as passes:
        theirs = engine.generate(prompt, MATRIX_NEW_TOKENS, context_tokens=CONTEXT)
    assert (counts["prefill"], counts["decode"]) == (1, 0)
    kept = policy.prefill_keep_count(CONTEXT)
    assert kept == BUDGET  # whole blocks at both granularities (a block rule's CONTEXT mod 32 = 18 no more)
    question = (CONTEXT, kept, PROMPT_TOKENS - CONTEXT)
    assert plain_passes.seen[:2] == passes.seen[:2] == [(0, 0, CONTEXT), question]
    assert ours == theirs
    assert plain.cache.get_seq_length() == kept + PROMPT_TOKENS - CONTEXT + MATRIX_NEW_TOKENS - 1
    for mine, theirs in zip(plain.cache.layers, engine.cache.layers, strict=True):
        torch.testing.assert_close(theirs.keys, mine.keys, rtol=0, atol=0)
        torch.testing.assert_close(theirs.values, mine.values, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["paged", pytest.param("snapkv", marks=pytest.mark.slow), pytest.param("h2o", marks=pytest.mark.slow)])
def test_context_tokens_at_the_prompt_end_is_prompt_compression(plain, prompt, name):
    """``context_tokens=len(prompt)`` runs today's path exactly, decode evictions included."""
    policy = make_policy(name, BUDGET, BLOCK)
    rule = plain_policy(name, BUDGET, BLOCK)
    engine = HFReferenceEngine(model_path("tiny"), policy)
    # past budget + block: decode evicts (a token rule's 96 tokens reach 128 after 32 decode passes,
    # the block rule's 108 sooner), and outputs follow that eviction
    new_tokens = BLOCK + 8
    default = engine.generate_with_top_logprobs(prompt, new_tokens)
    assert engine.generate_with_top_logprobs(prompt, new_tokens, context_tokens=len(prompt)) == default
    forced = engine.forced_logprobs(prompt, default[0])
    assert engine.forced_logprobs(prompt, default[0], context_tokens=len(prompt)) == forced
    plain_default = plain.generate(prompt, new_tokens, rule)
    assert plain_default[1]["decode"] >= 1
    assert plain.generate(prompt, new_tokens, rule, context_tokens=len(prompt)) == plain_default


def test_context_compression_differs_from_prompt_compression(prompt):
    """Evicting before the question is not evicting after it: the outputs part for some policy
    (the attention-aware ones see the question's queries only when the whole prompt is compressed)."""
    for name in ["snapkv", "h2o", "tova", "paged"]:  # the first that parts is enough
        engine = HFReferenceEngine(model_path("tiny"), compressing(name, {})[0])
        if engine.generate(prompt, NEW_TOKENS, context_tokens=CONTEXT) != engine.generate(prompt, NEW_TOKENS):
            break
    else:
        pytest.fail("context and prompt compression generated the same for every policy")


def test_context_mode_without_eviction_is_plain_greedy_decoding(plain, prompt):
    """Nothing evicted: prefilling the context and then the question is generating from the prompt."""
    engine = HFReferenceEngine(model_path("tiny"))
    with torch.no_grad():
        generated = engine.model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                          min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
    assert engine.generate(prompt, NEW_TOKENS, context_tokens=CONTEXT) == generated
    roomy = PlainPolicy("paged", "block", PROMPT_TOKENS + NEW_TOKENS, BLOCK, decode_eviction=False)
    ids, counts = plain.generate(prompt, NEW_TOKENS, roomy, context_tokens=CONTEXT)
    assert (ids, counts["prefill"], counts["decode"]) == (generated, 0, 0)


def test_context_compression_refuses_decode_eviction(plain, prompt):
    """A decode eviction after the question would drop question tokens: the setting forbids it."""
    with pytest.raises(ValueError, match="decode_eviction"):
        HFReferenceEngine(model_path("tiny"), make_policy("paged", BUDGET, BLOCK)).generate(
            prompt, 4, context_tokens=CONTEXT)
    with pytest.raises(ValueError, match="decode_eviction"):
        plain.generate(prompt, 4, plain_policy("paged", BUDGET, BLOCK), context_tokens=CONTEXT)


def test_the_harness_reference_refuses_a_policy_not_built_for_context_compression(prompt):
    """A policy as the engine never runs it under compress=context (no whole blocks: a block rule
    would keep CONTEXT mod B beside its budget) is refused, not silently compared."""
    policy = make_policy("paged", BUDGET, BLOCK)
    policy.decode_eviction = False
    with pytest.raises(ValueError, match="context compression keeps whole blocks"):
        HFReferenceEngine(model_path("tiny"), policy).generate(prompt, 4, context_tokens=CONTEXT)

"""KVzip in the two references, on the tiny checkpoint (loads a model: run under the engine lock).

The plain reference's passes leave no trace: with a budget above the context nothing is evicted,
and what it generates (and caches) equals a run without KVzip, so the pass's K/V is gone and the
question ran at the positions it would have without the pass. With a budget, the plain reference and
the Hugging Face reference (the harness's own evictor, policy and pass orchestration) generate the
same and keep the same K/V, at token and block granularity, one chunk or several, compressing the
context or the whole prompt. The harness's policy is built as the engine builds it
(``build_policy``): compressing the context, a block rule keeps exactly the budget, whole blocks
(``Policy.whole_blocks``, issue 49), which the plain reference derives from ``context_tokens``;
compressing the whole prompt, ``B + L mod B`` at the end as ever."""
from __future__ import annotations

import pytest
import torch

from harness.eviction.settings import EvictionSettings, Reconstruction, build_policy
from tests.support.engine_support import BLOCK, model_path, text_prompts
from tests.support.plain_reference import PlainPolicy, PlainReference, Repeat

pytestmark = pytest.mark.slow  # a real checkpoint loaded, generating

NEW_TOKENS = 20
SPEC = Reconstruction(prefix_tokens=10, first=(11, 12, 13, 14), later=(21, 22, 23), suffix=(31, 32))


def repeat(chunk: int) -> Repeat:
    return Repeat(SPEC.prefix_tokens, SPEC.first, SPEC.later, SPEC.suffix, chunk)


@pytest.fixture(scope="module")
def plain():
    return PlainReference(model_path("tiny"))


@pytest.fixture(scope="module")
def prompt():
    return text_prompts("tiny", [400], seed=4)[0]


def test_the_passes_leave_no_trace(plain, prompt):
    """Budget 512 above the 350-token context: the passes run, nothing is evicted, and the output and
    every layer's cache equal a run whose rule never reconstructs (knorm at the same budget)."""
    rule = PlainPolicy("kvzip", "token", 512, BLOCK, decode_eviction=False, repeat=repeat(128))
    ids, counts = plain.generate(prompt, NEW_TOKENS, rule, context_tokens=350)
    assert counts["prefill"] == 0 and rule.reconstructed is not None and rule.reconstructed[..., 10:].max() > 0
    kept = [layer.keys.clone() for layer in plain.cache.layers]
    plain_ids, _ = plain.generate(prompt, NEW_TOKENS, PlainPolicy("knorm", "token", 512, BLOCK, decode_eviction=False),
                                  context_tokens=350)
    assert ids == plain_ids
    for mine, theirs in zip(kept, plain.cache.layers):
        torch.testing.assert_close(mine, theirs.keys, rtol=0, atol=0)
    assert all(torch.equal(p, torch.arange(len(prompt) + NEW_TOKENS - 1).expand_as(p)) for p in plain.positions)


@pytest.mark.parametrize("granularity, chunk, context", [("token", 2048, 350), ("token", 100, 350),
                                                         ("block", 100, 350), ("token", 128, None),
                                                         ("block", 128, None)],
                         ids=["one_chunk", "chunks", "block_chunks", "whole_prompt", "block_whole_prompt"])
def test_the_plain_reference_equals_the_harness_reference(plain, prompt, granularity, chunk, context):
    from harness.eviction.hf_reference import HFReferenceEngine

    budget = 128
    rule = PlainPolicy("kvzip", granularity, budget, BLOCK, decode_eviction=False, repeat=repeat(chunk))
    ids, counts = plain.generate(prompt, NEW_TOKENS, rule, context_tokens=context)
    assert counts["prefill"] == 1 and counts["decode"] == 0
    # whole blocks compressing the context (350 = 10 blocks of 32 + 30): the budget exactly; the whole
    # 400-token prompt (12 blocks + 16): a block rule keeps its partial last block beside the budget
    assert all(length == budget + (len(prompt) % BLOCK if granularity == "block" and context is None else 0)
               + (len(prompt) - (context or len(prompt))) + NEW_TOKENS - 1 for length in counts["lengths"])
    policy = build_policy(EvictionSettings("kvzip", budget, {"granularity": granularity, "chunk_size": chunk},
                                           decode_eviction=False, compress="prompt" if context is None else "context"),
                          BLOCK)
    assert policy.whole_blocks == (context is not None)
    engine = HFReferenceEngine(model_path("tiny"), policy)
    assert engine.generate(prompt, NEW_TOKENS, context_tokens=context, reconstruction=SPEC) == ids
    for mine, theirs in zip(plain.cache.layers, engine.cache.layers, strict=True):
        torch.testing.assert_close(theirs.keys, mine.keys, rtol=0, atol=0)
        torch.testing.assert_close(theirs.values, mine.values, rtol=0, atol=0)
    # The header after the 4 sinks scores 0: it leaves first, in every layer and head (at token
    # granularity; a block rule keeps the whole first block).
    for positions in plain.positions:
        assert (positions[:, :4] == torch.arange(4)).all()
        if granularity == "token":
            assert not ((positions >= 4) & (positions < SPEC.prefix_tokens)).any()

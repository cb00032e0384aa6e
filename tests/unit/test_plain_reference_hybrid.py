"""The plain reference (tests/support/plain_reference.py) on a hybrid-attention model, the tiny Gemma 3
(``tiny-gemma3``: layers 2 and 5 global, the others a 32-token sliding window): the rule evicts the
global layers only; a local layer keeps Hugging Face's sliding-window cache, under a window mask. The engine
against this reference is tests/engine/test_hybrid_engine.py."""
from __future__ import annotations

import pytest
import torch

from harness.config.models import EMBEDDED_PREFIX, TINY_HYBRID, TINY_HYBRID_WINDOW, resolve_model_path
from tests.support.plain_reference import PlainPolicy, PlainReference

BLOCK = 8
PROMPT = 100  # past the window and the budgets below
NEW = 24
GLOBAL = [2, 5]


@pytest.fixture(scope="module")
def plain():
    return PlainReference(resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID))


@pytest.fixture(scope="module")
def prompt():
    from harness.tasks.embedded.token_prompts import token_prompts

    return token_prompts(resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID), [PROMPT], 5)[0]


def test_the_model_is_hybrid_as_the_reference_reads_it(plain):
    assert sorted(plain.local_layers) == [0, 1, 3, 4]


def test_a_budget_no_prompt_reaches_generates_what_hugging_face_generates(plain, prompt):
    """Nothing evicted: the per-layer masks of the global layers and the local layers' own masks give
    Hugging Face's greedy output (its own cache, its own masks)."""
    new = 8  # (Hugging Face's generate is slow here: a few tokens past the window show the masks)
    ids, counts = plain.generate(prompt, new, PlainPolicy("knorm", "token", 512, BLOCK, per_head=True))
    assert counts["prefill"] == counts["decode"] == 0
    expected = plain.model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, PROMPT:]
    assert ids == expected.tolist()


@pytest.mark.parametrize("score, granularity", [("knorm", "token"), ("paged", "block")])
def test_the_rule_evicts_the_global_layers_and_the_local_layers_hold_their_window(plain, prompt, score, granularity):
    budget = 48
    ids, counts = plain.generate(prompt, NEW, PlainPolicy(score, granularity, budget, BLOCK))
    assert counts["prefill"] == 1 and counts["decode"] >= 1
    lengths = counts["lengths"]
    for layer, length in enumerate(lengths):
        if layer in GLOBAL:
            assert budget <= length < budget + BLOCK + (PROMPT % BLOCK), (layer, lengths)
        else:  # never evicted: it has seen every token, and Hugging Face's sliding-window layer stores the
            # window but the newest query's own (DynamicSlidingWindowLayer.update)
            assert length == PROMPT + NEW - 1, (layer, lengths)
            assert plain.cache.layers[layer].keys.shape[-2] == TINY_HYBRID_WINDOW - 1
    if granularity == "block":  # one choice for the whole group: both global layers keep the same positions
        assert torch.equal(plain.positions[GLOBAL[0]], plain.positions[GLOBAL[1]])


def test_what_is_not_built_for_a_hybrid_model_is_refused(plain, prompt):
    rule = PlainPolicy("knorm", "token", 48, BLOCK, decode_eviction=False)
    with pytest.raises(ValueError, match="a hybrid model: one rule on its global layers"):
        plain.generate(prompt, NEW, [rule, PlainPolicy("knorm", "token", 48, BLOCK, decode_eviction=False)])


CONTEXT = 60  # the context's end: past the window; the question's 40 tokens past it too


def test_a_context_computed_before_its_question_and_not_evicted_generates_what_hugging_face_generates(plain, prompt):
    """The question (40 tokens, more than the window) computed after the context on a cache that holds
    it: the local layers' window mask over the 31 tokens they hold and the chunk gives Hugging Face's
    greedy output of the whole prompt."""
    new = 8
    ids, counts = plain.generate(prompt, new, PlainPolicy("knorm", "token", 512, BLOCK, decode_eviction=False),
                                 context_tokens=CONTEXT)
    assert counts["prefill"] == counts["decode"] == 0
    expected = plain.model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, PROMPT:]
    assert ids == expected.tolist()


@pytest.mark.parametrize("score, granularity", [("knorm", "token"), ("paged", "block")])
def test_a_compressed_context_evicts_the_global_layers_at_its_boundary_only(plain, prompt, score, granularity):
    """compress=context: the global layers evict the context down to the budget (whole blocks) once,
    before the question, never in decode; the local layers hold their window; the output differs from
    the uncompressed one's (the eviction reaches the answer)."""
    budget = 32
    ids, counts = plain.generate(prompt, NEW, PlainPolicy(score, granularity, budget, BLOCK, decode_eviction=False),
                                 context_tokens=CONTEXT)
    assert counts["prefill"] == 1 and counts["decode"] == 0
    for layer, length in enumerate(counts["lengths"]):
        if layer in GLOBAL:  # the context's budget, then the question and every output but the last
            assert length == budget + (PROMPT - CONTEXT) + NEW - 1, (layer, counts["lengths"])
        else:
            assert length == PROMPT + NEW - 1 and plain.cache.layers[layer].keys.shape[-2] == TINY_HYBRID_WINDOW - 1
    whole, _ = plain.generate(prompt, NEW, PlainPolicy(score, granularity, 512, BLOCK, decode_eviction=False),
                              context_tokens=CONTEXT)
    assert ids != whole


@pytest.mark.parametrize("name", ["paged", "streaming", "knorm", "snapkv"])
@pytest.mark.parametrize("mode", ["prompt", "context"])
def test_the_hugging_face_reference_equals_the_plain_rule_on_a_hybrid_model(plain, prompt, name, mode):
    """The harness's Hugging Face reference (``harness.eviction.hf_reference``: the engine's own step
    driver and policies on a DynamicCache) on the hybrid model, evicting the global layers and masking
    the local ones by their window, against the plain rule sharing no code with it: the same outputs
    and, layer by layer, the same cache, whole prompts (prefill and decode evictions) and a context
    compressed before its question."""
    from harness.eviction.hf_reference import HFReferenceEngine
    from harness.eviction.settings import EvictionSettings, build_policy
    from tests.support.engine_support import plain_policy

    budget, context = 48, (CONTEXT if mode == "context" else None)
    settings = EvictionSettings(policy=name, budget=budget, **({"compress": "context", "decode_eviction": False,
                                                                "context_tokens": CONTEXT} if context else {}))
    rule = plain_policy(name, budget, BLOCK)
    rule.decode_eviction = context is None
    engine = HFReferenceEngine(resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID), build_policy(settings, BLOCK))
    ids, counts = plain.generate(prompt, NEW, rule, context_tokens=context)
    assert counts["prefill"] == 1 and (counts["decode"] >= 1) == (context is None)
    assert engine.generate(prompt, NEW, context_tokens=context) == ids
    for layer, (mine, theirs) in enumerate(zip(plain.cache.layers, engine.cache.layers, strict=True)):
        torch.testing.assert_close(theirs.keys, mine.keys, rtol=0, atol=0, msg=f"layer {layer}")
        torch.testing.assert_close(theirs.values, mine.values, rtol=0, atol=0, msg=f"layer {layer}")


# KVzip's reconstruction ids (made-up ids: the tiny model has no chat template): a 5-token header,
# repeat prompts of 4 and 3 ids, a 2-id footer. Chunks of 20: passes of 26-33 tokens, near the window.
KVZIP_SPEC = {"prefix_tokens": 5, "first": (11, 12, 13, 14), "later": (21, 22, 23), "suffix": (31, 32)}


def kvzip_rule(granularity: str, budget: int, chunk: int):
    from tests.support.plain_reference import Repeat

    spec = KVZIP_SPEC
    return PlainPolicy("kvzip", granularity, budget, BLOCK, decode_eviction=False,
                       repeat=Repeat(spec["prefix_tokens"], spec["first"], spec["later"], spec["suffix"], chunk))


def test_kvzip_s_passes_on_a_hybrid_model_leave_no_trace(plain, prompt):
    """Budget 512 above the context: the passes run through every layer (the global layers scored),
    nothing is evicted, and the output and every layer's cache, the local layers' windows included,
    equal a run whose rule never reconstructs: each pass's K/V is gone from both kinds of layer."""
    rule = kvzip_rule("token", 512, 20)
    ids, counts = plain.generate(prompt, NEW, rule, context_tokens=CONTEXT)
    assert counts["prefill"] == 0 and rule.reconstructed is not None
    assert rule.reconstructed.shape[0] == len(GLOBAL) and rule.reconstructed[..., 5:].max() > 0
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in plain.cache.layers]
    plain_ids, _ = plain.generate(prompt, NEW, PlainPolicy("knorm", "token", 512, BLOCK, decode_eviction=False),
                                  context_tokens=CONTEXT)
    assert ids == plain_ids
    for (keys, values), theirs in zip(kept, plain.cache.layers, strict=True):
        torch.testing.assert_close(keys, theirs.keys, rtol=0, atol=0)
        torch.testing.assert_close(values, theirs.values, rtol=0, atol=0)


@pytest.mark.parametrize("granularity, context", [("token", CONTEXT), ("block", CONTEXT), ("token", None)],
                         ids=["token_context", "block_context", "token_whole_prompt"])
def test_kvzip_in_the_hugging_face_reference_equals_the_plain_rule_on_a_hybrid_model(plain, prompt, granularity,
                                                                                     context):
    """KVzip compressing the context (token and block granularity) or the whole prompt: the Hugging Face
    reference's passes (the model's own attention, the local layers under their window masks) and the
    plain rule's give the same outputs and the same cache, layer by layer; the output differs from the
    uncompressed one's."""
    from harness.eviction.hf_reference import HFReferenceEngine
    from harness.eviction.settings import EvictionSettings, Reconstruction, build_policy

    budget, chunk = 32, 20
    rule = kvzip_rule(granularity, budget, chunk)
    ids, counts = plain.generate(prompt, NEW, rule, context_tokens=context)
    assert counts["prefill"] == 1 and counts["decode"] == 0
    settings = EvictionSettings("kvzip", budget, {"granularity": granularity, "chunk_size": chunk}, decode_eviction=False,
                                compress="prompt" if context is None else "context")
    engine = HFReferenceEngine(resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID), build_policy(settings, BLOCK))
    assert engine.generate(prompt, NEW, context_tokens=context, reconstruction=Reconstruction(**KVZIP_SPEC)) == ids
    for layer, (mine, theirs) in enumerate(zip(plain.cache.layers, engine.cache.layers, strict=True)):
        torch.testing.assert_close(theirs.keys, mine.keys, rtol=0, atol=0, msg=f"layer {layer}")
        torch.testing.assert_close(theirs.values, mine.values, rtol=0, atol=0, msg=f"layer {layer}")
    whole, _ = plain.generate(prompt, NEW, kvzip_rule(granularity, 512, chunk), context_tokens=context)
    assert ids != whole

"""KVzip in the real engine (issue 50): the reconstruction passes run in the worker in the step whose
prefill reaches the eviction point (``harness.engine.reconstruction``), and what the engine then
generates equals the plain reference (``tests/support/plain_reference.py``, no code shared with
policies/ or harness/), whose question runs at the positions it would have without the passes.

One 400-token context (12 tokens of it taken as its header, never reconstructed; 620 before, CI time:
the plain reference's passes scale with it) and two questions, asked by KVzip at token granularity
with 256-token chunks (two passes, the later one after the previous chunk's last 8 ids), at block granularity, and compressing the whole prompt (one pass):
half the context (or prompt) kept. A second engine runs the same requests with prefix caching (the
second question about the context takes the compressed context), passes of at most 256 tokens per
forward (``max_num_batched_tokens``: the context's prefill is chunked, and a pass runs in pieces)
and the layers as two KV cache groups: it generates the same. (Preemption: skipped, no pool setting
preempted these requests.) ``run.py`` running a kvzip cell with the prompt builder's ids is one
cell of ``tests/engine/test_run_end_to_end.py``'s compress=context sweep (one engine for both)."""
from __future__ import annotations

import pytest

from harness.eviction.settings import EvictionSettings
from policies.kvzip import passes
from tests.support.engine_support import (BLOCK, assert_mostly_equal, assert_same_outputs, model_path, plain_policy,
                                          run_engine, scored_contexts, text_prompts)

pytestmark = pytest.mark.engine

NEW_TOKENS = 16  # (24 before, CI time)
RATIO = 0.5
PREFIX = 12
CASES = {  # name: (options, compress)
    "token_chunks": ({"chunk_size": 256}, "context"),
    "block": ({"granularity": "block", "chunk_size": 256}, "context"),
    "whole_prompt": ({}, "prompt"),
}


@pytest.fixture(scope="module")
def reconstruction():
    """The repeat prompts (kvpress 0.5.5's text, as the prompt builder has them) and the chat footer,
    as SmolLM2's tokenizer writes them."""
    from transformers import AutoTokenizer

    from harness.tasks.prompts import REPEAT_FIRST, REPEAT_LATER, chat_footer

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    return {"prefix_tokens": PREFIX, "first": encode(REPEAT_FIRST), "later": encode(REPEAT_LATER),
            "suffix": encode(chat_footer(tokenizer))}


@pytest.fixture(scope="module")
def requests(reconstruction):
    context = text_prompts("smollm2", [400], seed=8)[0]
    questions = text_prompts("smollm2", [40, 65], seed=9)
    asked = []
    for name, (options, compress) in CASES.items():
        for question in questions:
            settings = {"policy": "kvzip", "options": options, "budget": None, "budget_ratio": RATIO,
                        "decode_eviction": False, "compress": compress, "reconstruction": reconstruction}
            if compress == "context":
                settings["context_tokens"] = len(context)
            asked.append((name, context + question, settings))
    return asked


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, requests):
    prompts, settings = [p for _, p, _ in requests], [s for _, _, s in requests]
    workdir = tmp_path_factory.mktemp("kvzip")
    plain = run_engine(workdir, "smollm2", prompts, NEW_TOKENS, request_eviction=settings)
    # One engine for three things that each must leave the outputs alone (CI time: an engine start
    # and a run saved): shared compressed contexts, passes in pieces, two KV cache groups.
    pieces = run_engine(workdir, "smollm2", prompts, NEW_TOKENS, request_eviction=settings, prefix_caching=True,
                        max_num_batched_tokens=256, layer_groups=2)
    return plain, pieces


def pass_tokens(prompt: list[int], raw: dict) -> int:
    settings = EvictionSettings(**raw).for_prompt(len(prompt), BLOCK)
    spec, options = settings.reconstruction, raw["options"]
    point = settings.eviction_point(len(prompt))
    return sum(len(ids) for ids, _, _ in passes(prompt[:point], spec.prefix_tokens, spec.first, spec.later,
                                                spec.suffix, options.get("chunk_size", 2048), 8))


def test_the_engine_equals_the_plain_reference(engine_runs, requests):
    """Each request's output equals the plain reference's (near-tie rule as the other reference
    comparisons: ``assert_mostly_equal``); one prefill eviction per request, none in decode; the
    passes' tokens are the ledger's, run once per context (token and block granularity at the same
    chunk size, and a context's two questions, share its scores), and their time is inside the
    eviction's."""
    from tests.support.plain_reference import PlainReference, Repeat

    plain = PlainReference(model_path("smollm2"))
    run, _ = engine_runs
    reference = []
    for name, prompt, raw in requests:
        settings = EvictionSettings(**raw).for_prompt(len(prompt), BLOCK)
        options = raw["options"]
        rule = plain_policy("kvzip", settings.budget, BLOCK, options.get("granularity"))
        rule.decode_eviction = False
        spec = settings.reconstruction
        rule.repeat = Repeat(spec.prefix_tokens, spec.first, spec.later, spec.suffix, options.get("chunk_size", 2048))
        ids, counts = plain.generate(prompt, NEW_TOKENS, rule, context_tokens=settings.eviction_point(len(prompt))
                                     if settings.compress == "context" else None)
        assert counts["prefill"] == 1 and counts["decode"] == 0, name
        reference.append(ids)
    assert_mostly_equal(run["outputs"], reference)
    ledger = run["ledger"]
    assert ledger["evictions"] == {"prefill": len(requests), "decode": 0}
    scored = scored_contexts([(prompt, raw) for _, prompt, raw in requests])
    assert len(scored) == 3  # the context at 256-token chunks; each whole prompt
    assert ledger["reconstruct_tokens"] == sum(pass_tokens(requests[i][1], requests[i][2]) for i in scored)
    assert ledger["reconstruct_reused"] == len(requests) - len(scored)
    assert 0 < ledger["reconstruct_s"] <= ledger["evict_s"]
    assert run["free_blocks_after"] == run["free_blocks_before"] == ledger["kv_pool_blocks"]


def test_the_engine_equals_the_harness_reference(engine_runs, requests):
    """The Hugging Face reference (the harness's evictor and policy, the passes run through the
    model's own attention on a ``DynamicCache``) generates what the engine generates: one question
    per case (CI time: each runs its own passes; the plain reference above takes both, and
    tests/unit/test_kvzip_reference.py holds the two references equal, K/V included)."""
    from harness.eviction.hf_reference import HFReferenceEngine
    from harness.eviction.settings import build_policy

    run, _ = engine_runs
    chosen = range(0, len(requests), 2)  # each case's first question
    outputs = []
    for index in chosen:
        _, prompt, raw = requests[index]
        settings = EvictionSettings(**raw).for_prompt(len(prompt), BLOCK)
        engine = HFReferenceEngine(model_path("smollm2"), build_policy(settings, BLOCK))
        point = settings.eviction_point(len(prompt))
        outputs.append(engine.generate(prompt, NEW_TOKENS, context_tokens=point if point < len(prompt) else None,
                                       reconstruction=settings.reconstruction))
    assert len(outputs) == len(CASES)
    assert_mostly_equal([run["outputs"][index] for index in chosen], outputs)


def test_prefix_caching_pieces_and_two_groups_generate_the_same(engine_runs, requests):
    """With prefix caching the second question about the context takes the compressed context (its
    passes never run again); with passes in pieces of 256 tokens (and the context prefilled in
    chunks); and with the layers as two KV cache groups (uniform budgets: each group keeps what one
    group keeps of its layers; the passes score both groups' layers, the sinks above every group's
    scores): every request generates what it generated before (near-tie rule)."""
    plain, pieces = engine_runs
    assert_same_outputs(plain, pieces)
    ledger = pieces["ledger"]
    shared = ledger["shared_contexts"]
    assert shared["hits"] == 2  # token_chunks' and block's second questions
    compressing = [index for index, (_, _, raw) in enumerate(requests) if raw["compress"] == "prompt" or index % 2 == 0]
    assert ledger["evictions"]["prefill"] == 2 * len(compressing)  # counted per KV cache group
    scored = [compressing[i] for i in scored_contexts([requests[i][1:] for i in compressing])]
    assert ledger["reconstruct_tokens"] == sum(pass_tokens(requests[i][1], requests[i][2]) for i in scored)
    assert ledger["reconstruct_reused"] == len(compressing) - len(scored)
    assert pieces["free_blocks_after"] == ledger["kv_pool_blocks"]


@pytest.mark.skip(reason="no pool found that preempts these requests: five runs (three unshared requests at 40 and "
                         "36 blocks, four sharing two contexts at 40, all six at 34) preempted nothing, the scheduler "
                         "admitting them one after another; KVzip under preemption is NOT PROVEN (issue 50)")
def test_preempted_requests_reconstruct_again_and_generate_the_same(tmp_path, requests):
    """A pool too small for every request at once (as test_context_compression's preemption test,
    at this module's sizes): requests preempted after their eviction compute their context, and their
    passes, again (or take the shared context) and generate what they generate without preemption."""
    # Every request of the module at 34 blocks (three earlier tries preempted nothing: three unshared
    # requests at 40 and 36 blocks, four sharing two contexts at 40).
    chosen = requests
    prompts, settings = [p for _, p, _ in chosen], [s for _, _, s in chosen]
    roomy = run_engine(tmp_path / "roomy", "smollm2", prompts, 250, request_eviction=settings)
    tight = run_engine(tmp_path / "tight", "smollm2", prompts, 250, request_eviction=settings, num_kv_blocks=34,
                       max_model_len=1056, prefix_caching=True)
    assert sum(roomy["preemptions"]) == 0 and sum(tight["preemptions"]) > 0
    assert_same_outputs(roomy, tight)
    assert tight["free_blocks_after"] == tight["ledger"]["kv_pool_blocks"]

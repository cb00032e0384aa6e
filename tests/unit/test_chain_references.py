"""Chained turns (``chain=true``, issue 49 item 4) in the two references: a conversation's next turn
continues the cache its previous turn left (prompt and answer, as evicted then), computes its new
tokens up to its context boundary at their logical positions and compresses there what it holds, at
the budget its whole logical history resolves to (a ratio of 0.5: the budget recompression would
have). The plain reference (no shared code) and the Hugging Face reference (the harness's evictor
and step driver, the same code the engine's worker runs) must agree token for token and bit for bit
on every attention-free policy; and the plain reference shows what "by design" means: what one turn
dropped no later turn holds, where recompressing the pristine history would."""
from __future__ import annotations

import random

import pytest
import torch

from harness.eviction.hf_reference import HFReferenceEngine
from harness.eviction.settings import EvictionSettings, build_policy
from policies import make_policy
from tests.support.engine_support import BLOCK, model_path, plain_policy, text_prompts
from tests.support.plain_reference import PlainReference
from tests.support.policy_matrix import FAST_MODEL_CASES, MATRIX, case_id

PROMPT_TOKENS = 300
CONTEXT = 210           # turn 1: 70% of its prompt is context
NEW_TOKENS = 12         # each turn's answer
MESSAGE_TOKENS = 40     # each later turn's new message (after the answer: the boundary is the answer's end)
TURNS = 3
RATIO = 0.5


def chain_cases() -> list:
    """The matrix's attention-free cases (what a chain admits); the fast loop keeps PagedEviction
    and one token policy."""
    cases = []
    for name, options in MATRIX:
        policy = make_policy(name, 4 * BLOCK, BLOCK, **options)
        if policy.query_window or policy.accumulates:
            continue
        fast = (name in FAST_MODEL_CASES or name == "knorm") and not options
        cases.append(pytest.param(name, options, id=case_id(name, options), marks=() if fast else pytest.mark.slow))
    return cases


@pytest.fixture(scope="module")
def plain():
    return PlainReference(model_path("tiny"))


@pytest.fixture(scope="module")
def first_prompt():
    return text_prompts("tiny", [PROMPT_TOKENS], seed=11)[0]


def messages(count: int, vocabulary: int = 2000) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(100, vocabulary) for _ in range(MESSAGE_TOKENS)] for _ in range(count)]


def turn_budget(prompt_tokens: int, context: int) -> int:
    """The harness's own budget for a turn: the ratio resolved against the turn's context boundary,
    its whole logical history (``EvictionSettings.for_prompt``)."""
    settings = EvictionSettings("paged", None, budget_ratio=RATIO, decode_eviction=False, compress="context",
                                chain=True)
    return settings.at_context(context).for_prompt(prompt_tokens, BLOCK).budget


def held_positions(reference: PlainReference) -> list[list[set[int]]]:
    """Per layer and KV head, the logical positions the plain reference's cache holds."""
    return [[set(head.tolist()) for head in layer] for layer in reference.positions]


def chained_conversation(plain, engine, name, options, first_prompt):
    """Both references through the same conversation: each next prompt is the previous prompt, the
    plain reference's answer and a new message. Yields per turn (prompt, boundary, plain ids, engine
    ids, plain counts)."""
    prompt, boundary = list(first_prompt), CONTEXT
    extra = messages(TURNS)
    for turn in range(TURNS):
        budget = turn_budget(len(prompt), boundary)
        rule = plain_policy(name, budget, BLOCK, options.get("granularity"))
        rule.decode_eviction = False
        # the policy the engine's scheduler builds for this turn (compress=context: whole blocks kept)
        engine.use(build_policy(EvictionSettings(name, budget, dict(options), decode_eviction=False,
                                                 compress="context", chain=True), BLOCK))
        ours, counts = plain.generate(prompt, NEW_TOKENS, rule, context_tokens=boundary, resume=turn > 0)
        theirs = engine.generate(prompt, NEW_TOKENS, context_tokens=boundary, resume=turn > 0)
        yield prompt, boundary, ours, theirs, counts
        boundary = len(prompt) + len(ours)
        prompt = prompt + ours + extra[turn]


@pytest.mark.parametrize("name, options", chain_cases())
def test_chained_turns_plain_rule_equals_the_harness_reference(plain, first_prompt, name, options):
    """Token for token every turn, one prefill eviction per turn at its boundary, and the same K/V
    (bit for bit, every layer) at the end of every turn."""
    engine = HFReferenceEngine(model_path("tiny"), make_policy(name, 4 * BLOCK, BLOCK, **options))
    for turn, (prompt, boundary, ours, theirs, counts) in enumerate(
            chained_conversation(plain, engine, name, options, first_prompt)):
        assert ours == theirs, (turn, ours, theirs)
        assert (counts["prefill"], counts["decode"]) == (1, 0), (turn, counts)
        lengths = {plain.cache.get_seq_length(layer) for layer in range(len(plain.cache.layers))}
        budget = turn_budget(len(prompt), boundary)
        # what the turn holds: its compressed history (its budget exactly, whole blocks at every
        # granularity: compress=context) and what followed the boundary (the new message's tokens and
        # all but the last answer token)
        after = len(prompt) - boundary + NEW_TOKENS - 1
        assert lengths == {budget + after}, (turn, lengths, budget)
        for mine, theirs_layer in zip(plain.cache.layers, engine.cache.layers, strict=True):
            torch.testing.assert_close(theirs_layer.keys, mine.keys, rtol=0, atol=0)
            torch.testing.assert_close(theirs_layer.values, mine.values, rtol=0, atol=0)


def test_what_one_turn_dropped_no_later_turn_holds_where_recompression_would(plain, first_prompt):
    """PagedEviction, three turns: after each later turn every position below the previous turn's end
    that the cache holds was held when the previous turn ended (a chain only drops); recompressing
    the last turn's pristine history at the same budget keeps positions the chain had dropped."""
    engine = HFReferenceEngine(model_path("tiny"), make_policy("paged", 4 * BLOCK, BLOCK))
    before = None
    last = None
    for turn, (prompt, boundary, _, _, _) in enumerate(
            chained_conversation(plain, engine, "paged", {}, first_prompt)):
        now = held_positions(plain)
        if before is not None:
            end = len(plain_previous_tokens)
            for layer_now, layer_before in zip(now, before):
                for head_now, head_before in zip(layer_now, layer_before):
                    assert {p for p in head_now if p < end} <= head_before, turn
        before, plain_previous_tokens = now, list(plain.chain_tokens)
        last = (prompt, boundary)
    prompt, boundary = last
    rule = plain_policy("paged", turn_budget(len(prompt), boundary), BLOCK)
    rule.decode_eviction = False
    plain.generate(prompt, NEW_TOKENS, rule, context_tokens=boundary)  # recompressing: a fresh cache
    recompressed = held_positions(plain)
    dropped = set(range(CONTEXT)) - before[0][0]  # the first context's positions the chain no longer holds
    assert dropped & recompressed[0][0], "recompression keeps some of what the chain dropped"


def test_a_chained_turn_must_continue_the_previous_turn(plain, first_prompt):
    rule = plain_policy("paged", turn_budget(PROMPT_TOKENS, CONTEXT), BLOCK)
    rule.decode_eviction = False
    ours, _ = plain.generate(first_prompt, 4, rule, context_tokens=CONTEXT)
    with pytest.raises(ValueError, match="begins with the previous turn's prompt and output"):
        plain.generate([7] + first_prompt + ours, 4, rule, context_tokens=CONTEXT + 5, resume=True)
    plain.generate(first_prompt, 4, rule, context_tokens=CONTEXT)
    with pytest.raises(ValueError, match="computes at least one token before its boundary"):
        plain.generate(first_prompt + ours + [5, 6], 4, rule, context_tokens=PROMPT_TOKENS + 3, resume=True)

"""Query-agnostic compression in the real engine (``compress=context``): each request evicts when
its prefill reaches the end of its context, before any question token is computed, and the
question is prefilled on top of the compressed cache (kvpress's ``pipeline(context, question=...)``).

One context asked three questions, as separate requests, by every registered policy at every
granularity it runs at (``tests/support/policy_matrix.py``; two questions each) at a ratio of the
context, and by SnapKV compressing the whole prompt for contrast. Two engines run the same requests,
without and with prefix caching. With it, the context is prefilled once, its cached blocks never
written, and each policy compresses it once: the requests that ask about it after the first take the
compressed context (``harness.engine.shared_contexts``) and generate what they generate computing
their own. Both equal the plain reference (no code shared with policies/ or harness/) evicting at
the same boundary.

Every policy keeps exactly its budget of the context, whole blocks (PagedEviction too: its rule's
``L mod B`` tokens beside the budget are for a whole prompt, ``Policy.whole_blocks``), so a shared
context has no partial last block for its takers to copy; a separate engine checks what that holds.

The prefix-caching engine then runs two three-turn conversations with ``chain=true`` (PagedEviction
and Knorm; a chain entry ends mid-block, after its answer, and each next turn copies that partial
block): each later turn takes its previous turn's compressed cache, and every turn equals the plain
reference applying the same evictions turn by turn to the concatenated turns; no block a chain entry
holds is ever written."""
from __future__ import annotations

import pytest

from harness.eviction.settings import EvictionSettings, build_policy
from tests.support.engine_support import (BLOCK, assert_mostly_equal, assert_same_outputs, model_path, plain_policy,
                                          run_engine, text_prompts)
from tests.support.policy_matrix import MATRIX

pytestmark = pytest.mark.engine

# 16 new tokens (CI time: 32 before; every request of the module's two engines and the plain reference
# generates them); the whole-blocks test generates 32 of its own (WHOLE_BLOCKS_TOKENS).
NEW_TOKENS = 16
# The whole-blocks test's: its longest question (90 tokens) and 31 outputs end 25 tokens into a block,
# where the old rule's 12 extra context tokens would have needed one block more (asserted there).
WHOLE_BLOCKS_TOKENS = 32
RATIO = 0.5
# Preemption: vLLM admits a request when its peak as the scheduler predicts it fits (the 300-token
# context before its eviction: 10 blocks), and 120 outputs then grow the admitted requests past the
# pool of 24 (each its question and outputs, 5 to 7 blocks, beside its policy's 5 kept context blocks,
# shared). Measured (CI time: 250 outputs in a pool of 40 with a 620-token context before): 4
# preemptions of 3 of the 5 requests, all 4 after their eviction, 7 shared-context hits; pools of 20
# and 28 preempted 1 and 2. PREEMPT_LEN: vLLM's own limit, within the pool (24 blocks: 768 tokens).
PREEMPT_TOKENS, PREEMPT_POOL, PREEMPT_LEN = 120, 24, 600
# Chained conversations: a 300-token context and a 30-token question, then 20- and 25-token messages;
# 16 tokens per answer (a later turn's boundary is the previous answer's end).
CHAIN_POLICIES, CHAIN_TOKENS, CHAIN_TURNS = ("paged", "knorm"), 16, 3


def context_settings(name: str, options: dict, context_tokens: int) -> dict:
    return {"policy": name, "options": options, "budget": None, "budget_ratio": RATIO, "decode_eviction": False,
            "compress": "context", "context_tokens": context_tokens}


@pytest.fixture(scope="module")
def requests():
    """(prompt, settings) per request: one 300-token context and three questions of 40-90 tokens
    cut from elsewhere in the corpus; each policy of the matrix asks two of them in turn, then SnapKV
    asks each compressing the context, then each compressing the whole prompt."""
    # 300 tokens (CI time: 620 before; the plain reference and the engines' prefills scale with it):
    # 300 mod 32 = 12, a partial last block, as the whole-blocks test needs.
    context = text_prompts("smollm2", [300], seed=8)[0]
    prompts = [context + question for question in text_prompts("smollm2", [40, 65, 90], seed=9)]
    asked = [(prompts[(index + second) % 3], context_settings(name, options, len(context)))
             for second in (0, 1) for index, (name, options) in enumerate(MATRIX)]
    asked += [(prompt, context_settings("snapkv", {}, len(context))) for prompt in prompts]
    asked += [(prompt, {"policy": "snapkv", "budget": None, "budget_ratio": RATIO, "decode_eviction": False})
              for prompt in prompts]
    return asked


@pytest.fixture(scope="module")
def conversations():
    """Two conversations for the chain (batch_run's ``conversations``), one per CHAIN_POLICIES."""
    context, question = text_prompts("smollm2", [300], seed=21)[0], text_prompts("smollm2", [30], seed=22)[0]
    messages = text_prompts("smollm2", [20, 25], seed=23)
    return [{"prompt": context + question, "context_tokens": len(context), "messages": messages,
             "max_new_tokens": CHAIN_TOKENS,
             "eviction": {**context_settings(name, {}, len(context)), "context_tokens": None, "chain": True}}
            for name in CHAIN_POLICIES]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, requests, conversations):
    prompts, settings = [p for p, _ in requests], [s for _, s in requests]
    workdir = tmp_path_factory.mktemp("context")
    without = run_engine(workdir, "smollm2", prompts, NEW_TOKENS, request_eviction=settings)
    # (the chained conversations run on this engine after its batch, whose figures are taken before)
    cached = run_engine(workdir, "smollm2", prompts, NEW_TOKENS, request_eviction=settings,
                        prefix_caching=True, warm_cache=True, conversations=conversations)
    return without, cached


@pytest.fixture(scope="module")
def plain():
    from tests.support.plain_reference import PlainReference

    return PlainReference(model_path("smollm2"))


def kept_and_evicted(prompt: list[int], raw: dict) -> tuple[int, int]:
    """What the policy keeps of the part it compresses, and what it evicts of it."""
    settings = EvictionSettings(**raw).for_prompt(len(prompt), BLOCK)
    point = settings.eviction_point(len(prompt))
    kept = build_policy(settings, BLOCK).prefill_keep_count(point)
    return kept, point - kept


def first_asked(requests) -> list[int]:
    """The requests that compress their context: the first of each context and settings, and every
    whole-prompt one (each its own question's)."""
    seen, first = set(), []
    for index, (_, raw) in enumerate(requests):
        key = (raw["policy"], str(raw["options"])) if raw.get("compress") == "context" else index
        if key not in seen:
            seen.add(key)
            first.append(index)
    return first


# First (CI time): its engines, SmolLM2 without prefix caching and a small pool, run before the
# file's prefix-caching engine, which is then the last this file uses, kept for the first batch of
# tests/engine/test_prefix_caching.py with prefix caching (tests/engine/conftest.py).
def test_preempted_requests_evict_at_the_boundary_again_and_generate_the_same(tmp_path, requests):
    """A pool too small for every request at once: vLLM preempts requests that had already
    compressed their context or taken a shared one; each takes the shared context again (or, where
    the pool reclaimed it, compresses the context again at the same boundary) and generates what it
    generated, computing its own, without preemption."""
    context = [(p, s) for p, s in requests if s.get("compress") == "context"]
    chosen = [(p, s) for p, s in context if s["policy"] == "paged"] + context[-3:]  # two, and three SnapKV questions
    prompts, settings = [p for p, _ in chosen], [s for _, s in chosen]
    roomy = run_engine(tmp_path / "roomy", "smollm2", prompts, PREEMPT_TOKENS, request_eviction=settings)
    tight = run_engine(tmp_path / "tight", "smollm2", prompts, PREEMPT_TOKENS, request_eviction=settings,
                       num_kv_blocks=PREEMPT_POOL, max_model_len=PREEMPT_LEN, prefix_caching=True)
    assert sum(roomy["preemptions"]) == 0 and sum(tight["preemptions"]) > 0
    assert tight["ledger"]["preempted_after_eviction"] > 0, "preemption hit requests holding a compressed context"
    assert tight["ledger"]["shared_contexts"]["hits"] > 0
    assert_same_outputs(roomy, tight)
    assert tight["free_blocks_after"] == tight["ledger"]["kv_pool_blocks"]


def test_each_request_evicts_at_its_context_boundary_before_any_question_token(engine_runs, requests):
    """The first eviction of a request runs at its physical length, which before it equals the
    tokens computed: evicting exactly (context - kept) tokens means the eviction ran when the
    context, and nothing of the question, had been computed; whole-prompt compression evicts
    (prompt - kept) instead. With prefix caching, a context is compressed once per policy: every
    later request about it takes it (none computes or holds a copy of its own)."""
    without, cached = engine_runs
    first = first_asked(requests)
    for run, evicting in ((without, range(len(requests))), (cached, first)):
        ledger = run["ledger"]
        assert ledger["evictions"] == {"prefill": len(evicting), "decode": 0}
        assert ledger["evicted_tokens"] == sum(kept_and_evicted(*requests[index])[1] for index in evicting)
        assert run["free_blocks_after"] == run["free_blocks_before"] == ledger["kv_pool_blocks"]
    shared = cached["ledger"]["shared_contexts"]
    later = len(requests) - len(first)  # all about the context, none compressing the whole prompt
    assert (shared["published"], shared["hits"], shared["waits_given_up"]) == (len(first) - 3, later, 0)
    assert "shared_contexts" not in without["ledger"]  # no prefix caching: every request its own copy
    # The budget is the ratio of the context (300 tokens: 150, rounded to 5 whole blocks), not of
    # the prompt; every policy keeps exactly that, a block policy too (not the context's 300 mod 32).
    for prompt, raw in requests:
        if raw.get("compress") == "context":
            assert EvictionSettings(**raw).for_prompt(len(prompt), BLOCK).budget == 160
            assert kept_and_evicted(prompt, raw)[0] == 160


def test_context_compression_equals_the_plain_reference(engine_runs, requests, plain):
    reference = []
    # The others ask the same contexts other questions (compared below); the whole-prompt SnapKV
    # requests are the contrast only (test_engine_budget_ratio holds that mode to the plain reference).
    chosen = [index for index in first_asked(requests) if requests[index][1].get("compress") == "context"]
    for prompt, raw in [requests[index] for index in chosen]:
        settings = EvictionSettings(**raw).for_prompt(len(prompt), BLOCK)
        policy = plain_policy(raw["policy"], settings.budget, BLOCK, raw.get("options", {}).get("granularity"))
        policy.decode_eviction = False
        ids, counts = plain.generate(prompt, NEW_TOKENS, policy, context_tokens=settings.context_tokens)
        assert counts["prefill"] == 1 and counts["decode"] == 0
        reference.append(ids)
    without, _ = engine_runs
    assert_mostly_equal([without["outputs"][index] for index in chosen], reference)
    # The query-agnostic SnapKV differs from the query-aware one on the same prompts: where the
    # observation window sits (the context's end, or the question) is not a detail.
    context_mode, prompt_mode = without["outputs"][-6:-3], without["outputs"][-3:]
    assert context_mode != prompt_mode


def test_a_shared_context_is_cached_once_and_never_written(engine_runs):
    """Every request's output with prefix caching, and so with compressed contexts shared, equals
    the same request computed alone; no cached block changed (and the scheduler refuses any step
    that would write a block a shared context holds: ``ContextCache.check_writes``)."""
    without, cached = engine_runs
    assert_same_outputs(without, cached)
    blocks = cached["cached_blocks"]
    assert blocks["registered_before"] >= 9 and blocks["changed"] == 0  # the 300-token context's 9 and more
    assert cached["ledger"]["copy_target_blocks"] > 0  # compaction wrote blocks of its own


def test_a_kept_context_no_request_holds_is_taken_again_by_the_next_question(tmp_path, requests):
    """Questions that come one at a time (each sent when the one before has finished): between
    them the compressed context is held by no running request, so the cache lets its blocks go
    (free, and found again until the pool reuses them); the next question takes them again. Each
    output equals the same request computing its own (``share_context=false``, in the same engine,
    after them); the context is compressed once for three questions; every block comes back."""
    paged = next(raw for _, raw in requests if raw.get("compress") == "context" and raw["policy"] == "paged")
    prompts = [prompt for prompt, _ in requests[-3:]] * 2  # the context's three questions, twice
    settings = [paged] * 3 + [{**paged, "share_context": False}] * 3
    run = run_engine(tmp_path, "smollm2", prompts, NEW_TOKENS, request_eviction=settings, prefix_caching=True,
                     one_by_one=True)
    shared, own = ({key: run[key][cut] for key in ("outputs", "top_logprobs")} for cut in (slice(0, 3), slice(3, 6)))
    assert_same_outputs(own, shared)
    contexts = run["ledger"]["shared_contexts"]
    assert (contexts["published"], contexts["hits"], contexts["reclaimed"]) == (1, 2, 0)
    assert run["ledger"]["evictions"]["prefill"] == 1 + 3
    assert run["free_blocks_after"] == run["ledger"]["kv_pool_blocks"]


def test_a_shared_paged_context_is_whole_blocks_and_its_questions_hold_no_more(tmp_path, requests):
    """PagedEviction compressing the 300-token context (300 mod 32 = 12: its rule would keep those 12
    beside the 160-token budget for a whole prompt) keeps 160 tokens, 5 whole blocks: the one entry
    the cache pins is those 5 blocks (6 under the old rule), and while generating each request holds
    them and its own question's and answer's blocks, none carrying kept context tokens (no partial
    block copied at a hit): the shared questions and the same questions computing their own
    (``share_context=false``), all six at once in one engine, hold the same at their largest and
    generate the same."""
    paged = next(raw for _, raw in requests if raw.get("compress") == "context" and raw["policy"] == "paged")
    prompts = [prompt for prompt, _ in requests[-3:]]  # the context's three questions
    context = paged["context_tokens"]
    budget = EvictionSettings(**paged).for_prompt(len(prompts[0]), BLOCK).budget
    assert context % BLOCK and budget % BLOCK == 0  # a partial last block the old rule would have kept
    settings = [paged] * 3 + [{**paged, "share_context": False}] * 3
    run = run_engine(tmp_path, "smollm2", prompts * 2, WHOLE_BLOCKS_TOKENS, request_eviction=settings,
                     prefix_caching=True)
    shared, own = ({key: run[key][cut] for key in ("outputs", "top_logprobs")} for cut in (slice(0, 3), slice(3, 6)))
    assert_same_outputs(own, shared)
    ledger = run["ledger"]
    contexts = ledger["shared_contexts"]
    assert (contexts["published"], contexts["hits"]) == (1, 2)
    assert contexts["pinned_blocks_peak"] == budget // BLOCK == 5
    assert contexts["blocks_shared"] == 2 * budget // BLOCK
    assert ledger["evictions"]["prefill"] == 1 + 3
    # the last step of the longest question: the 5 kept blocks, then its question and all but its last
    # output token from a block boundary on (the old rule's 12 kept tokens first: one block more here)
    written = [len(prompt) - context + WHOLE_BLOCKS_TOKENS - 1 for prompt in prompts]
    assert ledger["decode_blocks_peak"] == budget // BLOCK + max(-(-n // BLOCK) for n in written)
    assert max(-(-(n + context % BLOCK) // BLOCK) for n in written) > max(-(-n // BLOCK) for n in written)
    assert run["free_blocks_after"] == ledger["kv_pool_blocks"]


def test_a_chained_conversation_equals_the_plain_reference_and_never_writes_a_kept_block(engine_runs, conversations,
                                                                                           plain):
    """Three turns per conversation (``chain=true``): every later turn takes the previous turn's kept
    cache (its prompt and all but its last answer token, not computed again), computes its new tokens
    up to its boundary and compresses there at the ratio of its whole history; each turn's output
    equals the plain reference continuing its own cache turn by turn (``PlainReference.generate``
    with ``resume``), compared as the other reference comparisons are (``assert_mostly_equal``: here
    every one of the six outputs); the K/V of every block a chain entry holds never changed (the
    scheduler also refuses any step writing one: ``ContextCache.check_writes``); every block back."""
    _, cached = engine_runs
    run = cached["conversations"]
    engine, reference, evictions = [], [], 0
    for index, conversation in enumerate(conversations):
        name = conversation["eviction"]["policy"]
        for turn, (prompt, boundary, output) in enumerate(zip(run["prompts"][index], run["boundaries"][index],
                                                              run["outputs"][index])):
            settings = EvictionSettings(**{**conversation["eviction"], "context_tokens": boundary})
            budget = settings.for_prompt(len(prompt), BLOCK).budget  # the ratio of this turn's whole history
            rule = plain_policy(name, budget, BLOCK)
            rule.decode_eviction = False
            ids, counts = plain.generate(prompt, CHAIN_TOKENS, rule, context_tokens=boundary, resume=turn > 0)
            evictions += counts["prefill"]
            engine.append(output)
            reference.append(ids)
            if ids != output:
                break  # the plain reference cannot continue a conversation it answered differently
            if turn:
                counters = run["request_counters"][index][turn]
                previous = run["prompts"][index][turn - 1]
                reused = len(previous) + CHAIN_TOKENS - 1  # the previous prompt and all but its last answer token
                assert (counters["chain_hits"], counters["chain_reused_tokens"]) == (1, reused)
    assert_mostly_equal(engine, reference)
    assert len(engine) == len(CHAIN_POLICIES) * CHAIN_TURNS
    ledger = run["ledger"]
    contexts = ledger["shared_contexts"]
    later = (CHAIN_TURNS - 1) * len(CHAIN_POLICIES)
    assert (contexts["chain_hits"], contexts["chain_published"]) == (later, CHAIN_TURNS * len(CHAIN_POLICIES))
    assert ledger["evictions"] == {"prefill": evictions, "decode": 0} and evictions >= later
    blocks = run["chain_blocks"]
    assert blocks["checked"] > 0 and blocks["changed"] == 0
    assert run["free_blocks_after"] == ledger["kv_pool_blocks"]

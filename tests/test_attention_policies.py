"""Attention-aware policies (SnapKV, H2O, TOVA): the window's attention, the policies' rules, the
per-request state, and the engine against both references (the harness's Hugging Face reference
and the plain one that shares no code with policies/ or harness/engine/)."""
from __future__ import annotations

import pytest
import torch

from harness.engine.evictor import MissingWindowError, ScoreBook, evict
from harness.engine.kv_view import FlashAttnView
from policies import make_policy
from policies.attention import Window, received_attention, window_attention


def test_window_attention_is_causal_softmax_over_the_cache_per_query_head():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(10, 2, 8, generator=gen)          # 10 cached tokens, 2 KV heads
    queries = torch.randn(3, 4, 8, generator=gen)        # the newest 3 tokens, 4 query heads
    probs = window_attention(Window(queries, 0.5), keys)  # [kv, group, n, tokens]
    assert probs.shape == (2, 2, 3, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 3))
    # Query head 3 reads KV head 1; window query 0 is the token in slot 7: it saw slots 0-7.
    direct = torch.softmax(queries[0, 3] @ keys[:8, 1].T * 0.5, dim=-1)
    torch.testing.assert_close(probs[1, 1, 0, :8], direct)
    assert probs[1, 1, 0, 8:].abs().sum() == 0 and probs[:, :, 1, 9].abs().sum() == 0
    assert received_attention(Window(queries, 0.5), keys).shape == (2, 10)


def test_snapkv_keeps_its_window_and_the_best_pooled_votes():
    policy = make_policy("snapkv", 64, 32, window=8)
    keys = torch.zeros(2, 100, 1, 4)
    keys[:, 40, 0, 0] = 30.0     # one key every query attends to
    queries = torch.zeros(8, 1, 4)
    queries[:, 0, 0] = 1.0
    kept = policy.prefill_keep(keys, torch.ones_like(keys), [Window(queries, 1.0)] * 2)
    assert kept.shape == (2, 1, 64)
    assert set(range(92, 100)) <= set(kept[0, 0].tolist()), "the window stays"
    assert {38, 39, 40, 41, 42} <= set(kept[0, 0].tolist()), "pooling keeps the voted token's neighbours"


@pytest.mark.parametrize("name, options, message", [
    ("snapkv", {"window": 256}, "window must be in [1, budget=256)"),
    ("snapkv", {"kernel": 4}, "kernel must be a positive odd number"),
    ("snapkv_block", {"window": 64}, "window=64 must be at most block_size=32"),
    ("h2o", {"window": 16}, "window=16 must be at least block_size=32"),
    ("h2o", {"recent": 256}, "recent must be in [0, budget=256)"),
])
def test_attention_policy_options_are_checked(name, options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make_policy(name, 256, 32, **options)


def test_h2o_keeps_half_the_budget_recent_by_default():
    assert make_policy("h2o", 256, 32).recent == 128


def paged_request(tokens: int, seed: int = 0):
    """A FlashAttention-layout cache of 3 layers, 2 KV heads, one request of ``tokens`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randn(16, 2, 8, 2 * 4, generator=gen) for _ in range(3)]
    return FlashAttnView(layers), list(range(16))[: -(-tokens // 8)], gen


def test_the_window_keeps_the_newest_queries_and_counts_the_uncounted():
    book = ScoreBook(scales=[1.0] * 3)
    book.observe("r", torch.arange(3 * 5).float().view(3, 5, 1, 1), size=4)
    assert book.windows["r"].queries[0, :, 0, 0].tolist() == [1, 2, 3, 4] and book.windows["r"].fresh == 4
    book.windows["r"].fresh = 0
    book.observe("r", torch.full((3, 1, 1, 1), 9.0), size=4)
    assert book.windows["r"].queries[0, :, 0, 0].tolist() == [2, 3, 4, 9] and book.windows["r"].fresh == 1
    assert [len(w) for w in book.layer_windows("r", fresh_only=True)] == [1, 1, 1]
    book.forget(["r"])
    assert not book.windows and book.nbytes() == 0


def test_an_attention_policy_without_its_window_refuses_to_evict():
    view, blocks, _ = paged_request(40)
    with pytest.raises(MissingWindowError, match="no queries were captured"):
        evict(make_policy("snapkv", 16, 8, window=4), view, blocks, 40, "prefill", ScoreBook(scales=[1.0] * 3), "r")


def test_h2o_totals_follow_their_tokens_and_add_up():
    """After an eviction the kept totals are the totals of the tokens now in those slots; the next
    eviction adds only the attention of the queries written since."""
    policy = make_policy("h2o", 16, 8, window=8, recent=4)
    view, blocks, gen = paged_request(40)
    book = ScoreBook(scales=[0.5] * 3)
    book.observe("r", torch.randn(3, 8, 2, 4, generator=gen), size=8)
    window = [Window(q, 0.5) for q in book.windows["r"].queries]
    keys = torch.stack([view.read_layer(l, blocks, 0, 40)[0] for l in range(3)])
    totals = torch.stack([received_attention(window[l], keys[l]) for l in range(3)])
    kept = policy.select_prefill(totals, 40, 3, 2)
    evict(policy, view, blocks, 40, "prefill", book, "r")
    torch.testing.assert_close(book.scores["r"], totals.gather(-1, kept))
    assert book.windows["r"].fresh == 0, "the window's queries are counted once"


# --- the engine -------------------------------------------------------------------------------

ATTENTION_POLICIES = ["snapkv", "snapkv_block", "h2o", "tova"]
BUDGET, NEW_TOKENS = 256, 64


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """One SmolLM2 engine, five prompts (600-1500 tokens) under each attention-aware policy at
    budget 256 in one batch: every prompt evicts in prefill, and 64 new tokens evict in decode."""
    from engine_support import mixed_lengths, run_engine, text_prompts

    prompts = text_prompts("smollm2", mixed_lengths(5, 600, 1500, seed=2), seed=2)
    settings = [{"policy": name, "budget": BUDGET} for name in ATTENTION_POLICIES for _ in prompts]
    run = run_engine(tmp_path_factory.mktemp("attention"), "smollm2", prompts * len(ATTENTION_POLICIES), NEW_TOKENS,
                     request_eviction=settings)
    return prompts, run


def outputs_of(run, index: int, count: int) -> list:
    return run["outputs"][index * count : (index + 1) * count]


@pytest.mark.engine
@pytest.mark.parametrize("policy", ATTENTION_POLICIES)
def test_engine_equals_the_harness_reference(mixed_run, policy):
    from engine_support import BLOCK, assert_mostly_equal, reference_outputs

    prompts, run = mixed_run
    index = ATTENTION_POLICIES.index(policy)
    assert_mostly_equal(outputs_of(run, index, len(prompts)),
                 reference_outputs("smollm2", make_policy(policy, BUDGET, BLOCK), prompts, NEW_TOKENS))


@pytest.fixture(scope="module")
def plain_runs(mixed_run):
    from engine_support import BLOCK, model_path
    from plain_reference import PlainPolicy, PlainReference

    prompts, _ = mixed_run
    plain = PlainReference(model_path("smollm2"))
    return {name: [plain.generate(prompt, NEW_TOKENS, PlainPolicy(name, BUDGET, BLOCK)) for prompt in prompts]
            for name in ATTENTION_POLICIES}


@pytest.mark.engine
@pytest.mark.parametrize("policy", ATTENTION_POLICIES)
def test_engine_equals_the_plain_reference(mixed_run, plain_runs, policy):
    from engine_support import assert_mostly_equal

    prompts, run = mixed_run
    index = ATTENTION_POLICIES.index(policy)
    assert_mostly_equal(outputs_of(run, index, len(prompts)), [ids for ids, _ in plain_runs[policy]])
    assert all(counts["prefill"] == 1 and counts["decode"] >= 1 for _, counts in plain_runs[policy])


@pytest.mark.engine
def test_engine_evicts_in_both_phases_returns_every_block_and_measures_the_capture(mixed_run, plain_runs):
    prompts, run = mixed_run
    ledger = run["ledger"]
    requests = len(prompts) * len(ATTENTION_POLICIES)
    assert ledger["evictions"]["prefill"] == requests
    assert ledger["evictions"]["decode"] == sum(c["decode"] for runs in plain_runs.values() for _, c in runs)
    assert run["free_blocks_after"] == run["free_blocks_before"] == ledger["kv_pool_blocks"]
    assert 0 < ledger["capture_s"] < ledger["model_s"]
    # Windows of 32 queries x 30 layers x 9 heads x 64 dims in float32 (2.2 MB) per live request.
    assert 0 < ledger["policy_state_bytes_peak"] <= requests * (32 * 30 * 9 * 64 * 4 + 30 * 3 * 2048 * 4)

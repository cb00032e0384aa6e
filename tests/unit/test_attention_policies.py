"""Attention-aware policies (SnapKV, H2O, TOVA): the window's attention, the policies' rules, the
per-request state, and H2O's totals when the prompt fits the budget (no engine). The same totals in
the engine against both references: tests/engine/test_h2o_within_budget.py; every attention-aware
policy in the engine: tests/engine/test_policy_matrix.py."""
from __future__ import annotations

import pytest
import torch

from harness.eviction.evictor import count_due, count_queries, evict, phase_due
from harness.eviction.state import MissingWindowError, PolicyState
from harness.engine.backend_views import FlashAttnView
from policies import make_policy
from policies.attention import Window, received_attention, window_attention
from tests.support.policy_probe import prefill_keep


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
    kept = prefill_keep(policy, keys, torch.ones_like(keys), [Window(queries, 1.0)] * 2)
    assert kept.shape == (2, 1, 64)
    assert set(range(92, 100)) <= set(kept[0, 0].tolist()), "the window stays"
    assert {38, 39, 40, 41, 42} <= set(kept[0, 0].tolist()), "pooling keeps the voted token's neighbours"


@pytest.mark.parametrize("name, options, message", [
    ("snapkv", {"window": 256}, "window must be in [1, budget=256)"),
    ("snapkv", {"kernel": 4}, "kernel must be a positive odd number"),
    ("snapkv_block", {"window": 240}, "keeps the 8 newest block(s) holding its window=240 and needs one more to evict: budget must be at least 288"),
    ("h2o", {"window": 0}, "window must be a positive number of queries, got 0"),
    ("h2o", {"recent": 256}, "recent must be in [0, budget=256)"),
])
def test_attention_policy_options_are_checked(name, options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make_policy(name, 256, 32, **options)


def test_h2o_keeps_half_the_budget_recent_by_default():
    assert make_policy("h2o", 256, 32).score.token_edges(256, 32) == (0, 128)


def paged_request(tokens: int, seed: int = 0):
    """A FlashAttention-layout cache of 3 layers, 2 KV heads, one request of ``tokens`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randn(16, 2, 8, 2 * 4, generator=gen) for _ in range(3)]
    return FlashAttnView(layers), list(range(16))[: -(-tokens // 8)], gen


def test_the_window_keeps_the_newest_queries_and_counts_the_uncounted():
    state = PolicyState(scales=[1.0] * 3)
    state.observe("r", torch.arange(3 * 5).float().view(3, 5, 1, 1), size=4)
    assert state.windows["r"].queries[0, :, 0, 0].tolist() == [1, 2, 3, 4] and state.windows["r"].fresh == 4
    state.windows["r"].fresh = 0
    state.observe("r", torch.full((3, 1, 1, 1), 9.0), size=4)
    assert state.windows["r"].queries[0, :, 0, 0].tolist() == [2, 3, 4, 9] and state.windows["r"].fresh == 1
    assert [len(w) for w in state.layer_windows("r", fresh_only=True)] == [1, 1, 1]
    state.forget(["r"])
    assert not state.windows and state.nbytes() == 0


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_an_attention_policy_without_its_window_refuses_to_evict(name):
    view, blocks, _ = paged_request(40)
    with pytest.raises(MissingWindowError, match="no queries were captured"):
        evict(make_policy(name, 16, 8, window=4), view, blocks, 40, "prefill", PolicyState(scales=[1.0] * 3), "r")


def test_h2o_totals_follow_their_tokens_and_add_up():
    """After an eviction the kept totals are the totals of the tokens now in those slots; the next
    eviction adds only the attention of the queries written since."""
    policy = make_policy("h2o", 16, 8, window=8, recent=4)
    view, blocks, gen = paged_request(40)
    state = PolicyState(scales=[0.5] * 3)
    state.observe("r", torch.randn(3, 8, 2, 4, generator=gen), size=8)
    window = [Window(q, 0.5) for q in state.windows["r"].queries]
    keys = torch.stack([view.read_layer(l, blocks, 0, 40)[0] for l in range(3)])
    totals = torch.stack([received_attention(window[l], keys[l]) for l in range(3)])
    kept = policy.select_prefill(totals, 40, 3, 2)
    evict(policy, view, blocks, 40, "prefill", state, "r")
    torch.testing.assert_close(state.scores["r"], totals.gather(-1, kept))
    assert state.windows["r"].fresh == 0, "the window's queries are counted once"


def test_h2o_counts_every_query_when_the_prompt_fits_the_budget():
    """A 20-token prompt under budget 32 (no prefill eviction) then decode to 40 tokens, one query a
    step, as the worker and the Hugging Face reference drive the evictor: at the decode eviction
    the totals hold what the prompt's last window and every decode query paid each token, each
    over the cache as that query saw it."""
    policy = make_policy("h2o", 32, 8, window=8, recent=8)
    view, blocks, gen = paged_request(40)
    keys = torch.stack([view.read_layer(l, blocks, 0, 40)[0] for l in range(3)])
    queries = torch.randn(3, 40, 2, 4, generator=gen)  # the query of every token, per layer
    state = PolicyState(scales=[0.5] * 3)
    prompt, counts = 20, 0
    state.observe("r", queries[:, prompt - 8 : prompt], size=8)
    for before in [0] + list(range(prompt, 40)):
        after = prompt if before == 0 else before + 1
        if before:
            state.observe("r", queries[:, before : after], size=8)
        phase = phase_due(policy, prompt, before, after, 0)
        if phase is None and count_due(policy, prompt, before, after, state, "r"):
            count_queries(policy, view, blocks, after, state, "r")
            counts += 1
    assert (phase, counts) == ("decode", 3), "counted at the prompt's end and twice when the window filled"
    expected = torch.zeros(3, 2, 40)
    for token in range(prompt - 8, 40):
        for layer in range(3):
            seen = received_attention(Window(queries[layer, token : token + 1], 0.5), keys[layer, : token + 1])
            expected[layer, :, : token + 1] += seen
    kept = policy.select_decode(expected, 40, 3, 2)
    evict(policy, view, blocks, 40, "decode", state, "r")
    torch.testing.assert_close(state.scores["r"], expected.gather(-1, kept))

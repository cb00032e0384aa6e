"""The evictor on hand-made paged caches (no engine): what it reads, and that cached scores decide
exactly as scores computed afresh."""
from __future__ import annotations

import copy

import pytest
import torch

from harness.eviction.evictor import Due, evict, evict_all
from harness.eviction.state import PolicyState
from harness.engine.backend_views import FlashAttnView
from policies import BlockPolicy, make_policy
from tests.support.policy_matrix import MATRIX, MATRIX_IDS

LAYERS, HEADS, DIM, B, BUDGET = 4, 2, 8, 4, 16
POOL = 40


class RecordingView(FlashAttnView):
    """A FlashAttention-layout view that records every run of slots it reads: (layer, start, end)."""

    def __init__(self, layers):
        super().__init__(layers)
        self.reads: list[tuple[int, int, int]] = []
        self.read_calls = 0
        self.keys_only_reads = 0

    def locate(self, runs):
        slots = super().locate(runs)
        slots.runs = [(start, end) for _, start, end in runs]
        return slots

    def read(self, layer, slots, values=True):
        self.reads.extend((layer, start, end) for start, end in slots.runs)
        self.read_calls += 1
        self.keys_only_reads += not values
        return super().read(layer, slots, values)


def request(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(POOL, HEADS, B, 2 * DIM, generator=gen) for _ in range(LAYERS)]
    block_ids = torch.randperm(POOL, generator=gen)[:12].tolist()
    return RecordingView(caches), block_ids


def grow(view, block_ids, start: int, count: int, seed: int) -> None:
    """Write ``count`` new tokens' K/V after slot ``start`` (what decode steps do)."""
    gen = torch.Generator().manual_seed(seed)
    for position in range(start, start + count):
        block, offset = block_ids[position // B], position % B
        for layer in view.layers:
            layer[block, :, offset] = torch.randn(HEADS, 2 * DIM, generator=gen)


def drop(block_ids, eviction):
    for position in sorted(eviction.dropped_blocks, reverse=True):
        del block_ids[position]


@pytest.mark.parametrize("policy_name", ["paged", "knorm", "keydiff", "streaming"])
def test_every_read_is_one_layer_of_one_request(policy_name):
    view, block_ids = request()
    evict(make_policy(policy_name, BUDGET, B), view, block_ids, 30, "prefill", PolicyState(), "r")
    assert view.reads, "the evictor read through the view"
    assert all(0 <= layer < LAYERS and 0 <= start < end <= 30 for layer, start, end in view.reads)


@pytest.mark.parametrize("policy_name, reads_values", [("snapkv", False), ("tova", False), ("paged", True),
                                                      ("knorm", True)])
def test_attention_scores_read_keys_alone(policy_name, reads_values):
    """An attention score's eviction gathers no values for scoring: every layer's scoring read is
    of keys alone (compaction still moves both)."""
    policy = make_policy(policy_name, BUDGET, B, **({"window": 4} if policy_name == "snapkv" else {}))
    view, block_ids = request()
    state = PolicyState(scales=[DIM ** -0.5] * LAYERS)
    if policy.query_window:
        state.observe("r", torch.randn(LAYERS, policy.query_window, HEADS, DIM), policy.query_window)
    evict(policy, view, block_ids, 30, "prefill", state, "r")
    assert view.read_calls and view.keys_only_reads == (0 if reads_values else LAYERS)


def test_a_block_policys_decode_eviction_scores_only_the_newest_tokens():
    """PagedEviction keeps one float per token between evictions: in steady state a decode
    eviction reads the block written since the last one, never the request's older K/V."""
    policy, state = make_policy("paged", BUDGET, B), PolicyState()
    view, block_ids = request()
    prompt = 22
    first = evict(policy, view, block_ids, prompt, "prefill", state, "r")
    drop(block_ids, first)
    tokens = prompt - first.evicted_tokens  # C + L mod B = 18
    assert state.scores["r"].shape == (1, 1, tokens)
    for step in range(3):
        grow(view, block_ids, tokens, BUDGET + B - tokens, seed=step)
        view.reads.clear()
        eviction = evict(policy, view, block_ids, BUDGET + B, "decode", state, "r")
        assert {(start, end) for _, start, end in view.reads} == {(tokens, BUDGET + B)}
        assert len(view.reads) == LAYERS
        drop(block_ids, eviction)
        tokens = BUDGET
        assert state.scores["r"].shape[-1] == tokens


@pytest.mark.parametrize("policy_name, options", [
    ("paged", {}), ("paged", {"per_head": True}), ("paged", {"score_layers": 1}), ("knorm", {}),
    ("knorm", {"per_head": False}),
])
def test_cached_scores_decide_exactly_as_fresh_ones(policy_name, options):
    """One request evicted through prefill and five decode evictions twice: with a score state and
    without (every score recomputed from the cache): the same blocks go, the same K/V stay."""
    policy = make_policy(policy_name, BUDGET, B, **options)
    cached_view, cached_blocks = request(seed=1)
    fresh_view, fresh_blocks = copy.deepcopy(cached_view), list(cached_blocks)
    state, tokens = PolicyState(), 27
    for step in range(6):
        phase = "prefill" if step == 0 else "decode"
        if step:
            for view, blocks in ((cached_view, cached_blocks), (fresh_view, fresh_blocks)):
                grow(view, blocks, tokens, BUDGET + B - tokens, seed=10 + step)
            tokens = BUDGET + B
        with_state = evict(policy, cached_view, cached_blocks, tokens, phase, state, "r")
        without = evict(policy, fresh_view, fresh_blocks, tokens, phase)
        assert with_state == without
        drop(cached_blocks, with_state)
        drop(fresh_blocks, without)
        tokens -= with_state.evicted_tokens
        for layer in range(LAYERS):
            assert all(torch.equal(a, b) for a, b in zip(cached_view.read_layer(layer, cached_blocks, 0, tokens),
                                                          fresh_view.read_layer(layer, fresh_blocks, 0, tokens)))


def test_released_requests_leave_the_book():
    state = PolicyState({"a": torch.zeros(1, 1, 5), "b": torch.zeros(1, 1, 7)})
    assert state.nbytes() == 12 * 4
    state.forget(["a", "missing"])
    assert list(state.scores) == ["b"]


@pytest.mark.parametrize("joint_read_bytes", [None, 3000], ids=["all_together", "small_groups"])
@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_evicting_a_steps_requests_together_equals_evicting_them_one_by_one(name, options, joint_read_bytes):
    """Three requests due in one step (one prefill, two decode, one with a copy target):
    ``evict_all`` leaves the same K/V in every slot, the same block lists and the same per-request
    state as evicting them one at a time; with no limit on a joint read it reads each layer at most
    twice (scores, then compaction) for all of them, with a small one in groups."""
    budget, heads, query_heads = 40, HEADS, 2 * HEADS  # room for SnapKV's 32-token window
    gen = torch.Generator().manual_seed(len(name))
    caches = [torch.randn(POOL, heads, B, 2 * DIM, generator=gen) for _ in range(LAYERS)]
    blocks = torch.randperm(POOL, generator=gen).tolist()
    cases = [("a", blocks[0:13], 50, "prefill", ()), ("b", blocks[13:24] + [blocks[39]], budget + B, "decode", (1,)),
             ("c", blocks[24:35], budget + B, "decode", ())]
    windows = {rid: torch.randn(LAYERS, 8, query_heads, DIM, generator=gen) for rid, *_ in cases}

    def run(together: bool):
        view = RecordingView([c.clone() for c in caches])
        view.joint_read_bytes = joint_read_bytes
        state = PolicyState(scales=[0.3] * LAYERS)
        policies = {}
        for rid, *_ in cases:
            policies[rid] = make_policy(name, budget, B, **options)
            if policies[rid].query_window:
                state.observe(rid, windows[rid], policies[rid].query_window)
        dues = [Due(rid, policies[rid], list(ids), tokens, phase, targets) for rid, ids, tokens, phase, targets in cases
                if not (phase == "decode" and targets and isinstance(policies[rid], BlockPolicy))]
        if together:
            evictions = evict_all(view, dues, state)
        else:
            evictions = {due.request_id: evict(due.policy, view, due.block_ids, due.tokens, due.phase, state,
                                               due.request_id, due.copy_targets) for due in dues}
        return view, state, evictions

    (one_view, one_state, one_evictions), (all_view, all_state, all_evictions) = run(False), run(True)
    assert all_evictions == one_evictions
    assert all(torch.equal(a, b) for a, b in zip(all_view.layers, one_view.layers))
    assert one_state.scores.keys() == all_state.scores.keys()
    assert all(torch.equal(one_state.scores[r], all_state.scores[r]) for r in one_state.scores)
    if joint_read_bytes is None:
        assert all_view.read_calls <= 2 * LAYERS
    else:  # 3000 bytes hold 23 tokens' K/V at this shape: every request reads alone
        assert all_view.read_calls > 2 * LAYERS

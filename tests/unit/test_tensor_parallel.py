"""Eviction split over tensor-parallel ranks, without an engine: each rank holds half of every
layer's KV heads (and the query heads that read them), scores them alone, exchanges its scores
with the other rank and compacts its own heads (``harness.eviction.shards``). Two threads stand
for the two ranks; their collective is a barrier here and vLLM's tensor-parallel group in the
engine (``tests/engine/test_engine_tensor_parallel.py`` runs that one). What a rank leaves in its heads must
equal that slice of what a single worker leaves in all of them, for every policy in the matrix."""
from __future__ import annotations

import threading

import pytest
import torch

from harness.engine.backend_views import FlashAttnView
from harness.eviction.evictor import Due, evict_all
from harness.eviction.shards import HeadShards, RankDisagreementError
from harness.eviction.state import PolicyState
from policies import BlockPolicy, make_policy
from tests.support.policy_matrix import MATRIX, MATRIX_IDS

LAYERS, HEADS, QUERY_HEADS, DIM, B, POOL, BUDGET = 3, 4, 8, 8, 4, 40, 40
RANKS = 2


class ThreadGroup:
    """``size`` threads' all-gather along dim 0, in rank order (what vLLM's group does across processes)."""

    def __init__(self, size: int):
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def all_gather(self, rank: int):
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor
            self.barrier.wait()
            out = torch.cat(self.slots, dim=0)
            self.barrier.wait()
            return out
        return gather


def on_ranks(work):
    """``work(rank, shards)`` on each rank's thread; their results (or the first error) in rank order."""
    group, results, errors = ThreadGroup(RANKS), [None] * RANKS, [None] * RANKS

    def run(rank):
        try:
            results[rank] = work(rank, HeadShards(rank, RANKS, group.all_gather(rank)))
        except RankDisagreementError as error:  # raised by every rank after the same collective
            errors[rank] = error
        except BaseException as error:  # noqa: BLE001 - handed to the test below
            errors[rank] = error
            group.barrier.abort()  # the other rank may be waiting in a collective

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def step_cases(name: str):
    """Three requests due in one step: one prefill, two decode (one with a copy target)."""
    gen = torch.Generator().manual_seed(len(name) + 7)
    caches = [torch.randn(POOL, HEADS, B, 2 * DIM, generator=gen) for _ in range(LAYERS)]
    blocks = torch.randperm(POOL, generator=gen).tolist()
    cases = [("a", blocks[0:13], 50, "prefill", ()), ("b", blocks[13:24] + [blocks[39]], BUDGET + B, "decode", (1,)),
             ("c", blocks[24:35], BUDGET + B, "decode", ())]
    windows = {rid: torch.randn(LAYERS, 8, QUERY_HEADS, DIM, generator=gen) for rid, *_ in cases}
    return caches, cases, windows


def evict_step(name, options, caches, cases, windows, heads: slice, query_heads: slice, shards=None):
    view = FlashAttnView([c[:, heads].clone() for c in caches])
    state = PolicyState(scales=[0.3] * LAYERS)
    policies = {rid: make_policy(name, BUDGET, B, **options) for rid, *_ in cases}
    for rid, policy in policies.items():
        if policy.query_window:
            state.observe(rid, windows[rid][:, :, query_heads], policy.query_window)
    dues = [Due(rid, policies[rid], list(ids), tokens, phase, targets) for rid, ids, tokens, phase, targets in cases
            if not (phase == "decode" and targets and isinstance(policies[rid], BlockPolicy))]
    evictions = evict_all(view, dues, state, shards) if shards else evict_all(view, dues, state)
    return view, state, evictions


@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_two_ranks_leave_each_of_their_heads_as_one_worker_leaves_it(name, options):
    caches, cases, windows = step_cases(name)
    one_view, one_state, one_evictions = evict_step(name, options, caches, cases, windows, slice(None), slice(None))
    local, local_queries = HEADS // RANKS, QUERY_HEADS // RANKS

    def rank_step(rank, shards):
        return evict_step(name, options, caches, cases, windows, shards.local(local),
                          slice(rank * local_queries, (rank + 1) * local_queries), shards)

    results, errors = on_ranks(rank_step)
    assert errors == [None] * RANKS, errors
    for rank, (view, state, evictions) in enumerate(results):
        assert evictions == one_evictions
        heads = slice(rank * local, (rank + 1) * local)
        for mine, whole in zip(view.layers, one_view.layers):
            torch.testing.assert_close(mine, whole[:, heads], rtol=0, atol=0)
        # every rank keeps the state a single worker keeps: scores of every head
        assert state.scores.keys() == one_state.scores.keys()
        for rid in one_state.scores:
            torch.testing.assert_close(state.scores[rid], one_state.scores[rid], rtol=1e-6, atol=1e-7)


def test_a_rank_whose_state_drifted_stops_every_rank():
    """Rank 1's cached PagedEviction scores are changed between two evictions (what a lost or
    doubled update would do): at the decode eviction the ranks choose different blocks, and both
    stop with the reason rather than let the scheduler apply rank 0's choice to rank 1's cache."""
    caches, cases, windows = step_cases("paged")
    prompt = [("a", cases[0][1], 50, "prefill", ())]

    def drift(rank, shards):
        view, state, first = evict_step("paged", {}, caches, prompt, windows, shards.local(HEADS // RANKS),
                                        slice(None), shards)
        kept = [prompt[0][1][p] for p in first["a"].kept_blocks]
        tokens = 50 - first["a"].evicted_tokens
        if rank == 1:
            state.scores["a"] = state.scores["a"].flip(-1)
        policy = make_policy("paged", BUDGET, B)
        return evict_all(view, [Due("a", policy, kept + prompt[0][1][len(kept):], BUDGET + B, "decode")], state, shards)

    # tokens after prefill are C + L mod B = 42 of 50; growing to BUDGET + B = 44 makes decode due
    _, errors = on_ranks(drift)
    assert all(isinstance(error, RankDisagreementError) for error in errors), errors
    assert "rank(s) [1] chose different evictions than rank 0" in str(errors[0])


def test_one_rank_needs_no_collective_and_more_need_one():
    assert HeadShards().gather_heads([torch.ones(2, 3, 4)])[0].shape == (2, 3, 4)
    with pytest.raises(ValueError, match="needs a collective"):
        HeadShards(0, 2)
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        HeadShards(2, 2, lambda x: x)

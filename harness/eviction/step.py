"""One step's evictions, free of vLLM: the driver that the engine's worker, the Hugging Face
reference and the scheduling tests all run.

After a step has written its K/V, each request that took part says where it stands
(``StepRequest``: its policy per KV cache group, its block lists, the logical tokens computed
before and after the step, the tokens each group had evicted before it). ``evict_step`` then does
what is due: a query count where an accumulating policy's window is full of uncounted queries
(``count_due``), and the prefill or decode evictions (``phase_due``), all of a group together
(``evict_all``). A request's block lists take their new shape in place, and the evictions that
changed something are returned for the scheduler. What calls it supplies the K/V views and keeps
the rest: the worker the physical inputs, vLLM's block table and the report's timing; the
Hugging Face reference its contiguous cache; the tests their hand-written K/V.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.eviction.evictor import Due, Eviction, PolicyFailure, count_due, count_queries, evict_all, phase_due
from harness.eviction.kv_view import KVView
from harness.eviction.shards import SINGLE, HeadShards
from harness.eviction.state import PolicyState
from policies import Policy


@dataclass
class StepRequest:
    request_id: str
    policies: tuple[Policy, ...]       # its policy in each KV cache group (each its own share of the budget)
    block_ids: list[list[int]]         # its block list in each group: reshaped in place by an eviction
    eviction_point: int                # the logical length its prefill eviction runs at (prompt's or context's end)
    before: int                        # logical tokens computed before this step
    after: int                         # ... and after it
    evicted: tuple[int, ...]           # tokens each group had evicted before this step
    # per group: (position in the block list, block) pairs whose block is shared (prefix cache) and
    # the fresh block compaction writes instead
    copy_targets: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)


def evict_step(views: list[KVView], states: list[PolicyState], requests: list[StepRequest],
               shards: HeadShards = SINGLE, failures: dict[str, PolicyFailure] | None = None
               ) -> dict[tuple[str, int], Eviction]:
    """The query counts and evictions due after a step, one group (``views[g]``, ``states[g]``) at a
    time for every request together; returns ``{(request_id, group): Eviction}`` for those that
    changed the request's cache. A request whose policy fails raises, or, given ``failures``, is
    named there and goes no further (the others are evicted as without it)."""
    dues: list[list[Due]] = [[] for _ in views]
    blocks_of = {}
    for request in requests:
        rid = request.request_id
        for group, policy in enumerate(request.policies):
            if failures is not None and rid in failures:
                break
            evicted, state, block_ids = request.evicted[group], states[group], request.block_ids[group]
            phase = phase_due(policy, request.eviction_point, request.before, request.after, evicted)
            if phase is None:
                if count_due(policy, request.eviction_point, request.before, request.after, state, rid):
                    try:
                        count_queries(policy, views[group], block_ids, request.after - evicted, state, rid, shards)
                    except PolicyFailure as failure:
                        if failures is None:
                            raise
                        failures[rid] = failure
                continue
            targets = request.copy_targets.get(group, ())
            held = block_ids + [block for _, block in targets]  # copy targets follow the request's blocks
            blocks_of[(rid, group)] = (block_ids, held)
            dues[group].append(Due(rid, policy, held, request.after - evicted, phase,
                                   tuple(position for position, _ in targets)))
    changed = {}
    for group, group_dues in enumerate(dues):
        group_dues = [due for due in group_dues if failures is None or due.request_id not in failures]
        if not group_dues:
            continue
        for rid, eviction in evict_all(views[group], group_dues, states[group], shards, failures).items():
            if not (eviction.evicted_tokens or eviction.changes_blocks):
                continue  # nothing moved: not reported
            block_ids, held = blocks_of[(rid, group)]
            block_ids[:] = [held[position] for position in eviction.kept_blocks]
            changed[(rid, group)] = eviction
    return changed

"""The scheduler's side of shared contexts (``harness.engine.context_sharing.ContextSharing``) on
its own: a request waits while another compresses its context, at most ``CONTEXT_WAIT_STEPS``
steps, and a request that lets go of its blocks gives up its claims. The whole path, on the real
scheduler and block pool, is ``test_shared_contexts``, ``test_chain_scheduler`` and
``test_context_whole_blocks``."""
from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.core.block_pool import BlockPool

from harness.engine.context_sharing import CONTEXT_WAIT_STEPS, ContextSharing
from harness.engine.shared_contexts import ContextCache
from harness.eviction.counters import RequestCounters


def sharing() -> ContextSharing:
    counters = {"r1": RequestCounters(policy="paged", budget=64), "r2": RequestCounters(policy="paged", budget=64)}
    scheduler = SimpleNamespace(kv_request_counters=counters)
    return ContextSharing(scheduler, ContextCache(BlockPool(8, enable_caching=True, hash_block_size=4)))


def waiting(request_id: str, computed: int = 0):
    return SimpleNamespace(request_id=request_id, num_computed_tokens=computed)


def test_a_request_waits_while_another_compresses_its_context_then_compresses_its_own():
    shared = sharing()
    shared.admit("r1", ("key",))
    shared.admit("r2", ("key",))
    shared.cache.owners[("key",)] = "r1"
    shared.compressing["r1"] = ("key",)
    assert shared.ready(waiting("r1"))  # the owner compresses
    assert shared.ready(waiting("r3"))  # a request of no context never waits
    assert [shared.ready(waiting("r2")) for _ in range(CONTEXT_WAIT_STEPS)] == [False] * CONTEXT_WAIT_STEPS
    assert shared.ready(waiting("r2"))  # waited long enough: compresses its own
    assert shared.cache.stats.wait_steps == CONTEXT_WAIT_STEPS and shared.cache.stats.waits_given_up == 1
    assert shared.scheduler.kv_request_counters["r2"].context_wait_steps == CONTEXT_WAIT_STEPS


def test_a_request_that_lets_go_gives_up_its_claims_and_a_finished_one_its_records():
    shared = sharing()
    shared.admit("r1", ("key",))
    shared.cache.owners[("key",)] = "r1"
    shared.compressing["r1"] = ("key",)
    shared.ready(waiting("r2"))
    shared.forget(waiting("r1"), finished=False)  # preempted: it may compress again when it returns
    assert ("key",) not in shared.cache.owners and not shared.compressing and shared.keys == {"r1": ("key",)}
    shared.forget(waiting("r1"), finished=True)
    assert not shared.keys
    shared.admit("r2", ("key",))
    shared.cache.owners[("key",)] = "r1"
    assert not shared.ready(waiting("r2"))
    assert shared.ready(waiting("r2", computed=8))  # already running its prefill: never held back

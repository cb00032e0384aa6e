"""Scheduler side of eviction (engine-core process): block accounting and freeing.

Each request's *evicted token count* (logical length minus physical length) lives in a ledger
shared by the scheduler and its KV managers:

* allocation asks for blocks by the physical count (logical minus evicted), so blocks that were
  given back are never re-allocated to the request;
* the worker reports, with each step's output, which of a request's blocks it emptied; they leave
  the request's block list and go back to vLLM's block pool at once (``update_from_output``);
* each ``SchedulerOutput`` carries the counts (``kv_evicted_tokens``) so the worker can turn
  logical positions into physical slots;
* freeing a request (finish, abort, preemption) forgets its count; a preempted request is then
  replayed one token per step after its prompt, so it meets the same evictions at the same steps.

The ledger also records what the memory claims rest on: blocks in use per step, concurrency,
evictions and their cost. With eviction off only those measurements run; vLLM decides as before.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from harness.engine.settings import build_policy, check_compatible, settings_from


@dataclass
class Ledger:
    policy_name: str | None
    evicted: dict[str, int] = field(default_factory=dict)
    pool_blocks: int = 0
    steps: int = 0
    used_blocks_sum: int = 0
    used_blocks_peak: int = 0
    running_peak: int = 0
    decode_blocks_peak: int = 0  # most blocks any request held while generating
    preempted_after_eviction: int = 0  # preemptions that dropped a request's eviction state
    evictions: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    freed_blocks: int = 0
    evicted_tokens: int = 0
    copied_tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    evict_s: float = 0.0
    model_s: float = 0.0

    def reset_measurements(self) -> None:
        """Start counting afresh (between repeats of a benchmark on one engine); the live
        requests' evicted counts are state, not measurements, and stay."""
        fresh = Ledger(self.policy_name, evicted=self.evicted, pool_blocks=self.pool_blocks)
        self.__dict__.update(fresh.__dict__)

    def snapshot(self) -> dict:
        return {
            "policy": self.policy_name,
            "kv_pool_blocks": self.pool_blocks,
            "steps": self.steps,
            "kv_blocks_used_peak": self.used_blocks_peak,
            "kv_blocks_used_mean": self.used_blocks_sum / self.steps if self.steps else 0.0,
            "running_requests_peak": self.running_peak,
            "decode_blocks_peak": self.decode_blocks_peak,
            "preempted_after_eviction": self.preempted_after_eviction,
            "evictions": dict(self.evictions),
            "freed_blocks": self.freed_blocks,
            "evicted_tokens": self.evicted_tokens,
            "copied_tokens": dict(self.copied_tokens),
            "evict_s": self.evict_s,
            "model_s": self.model_s,
            "evict_share_of_step": self.evict_s / self.model_s if self.model_s else 0.0,
        }


def _physical(manager, request_id: str, num_tokens: int) -> int:
    evicted = getattr(manager, "_kv_evicted", None)
    return num_tokens - evicted.get(request_id, 0) if evicted else num_tokens


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

    if getattr(Scheduler, "_kv_eviction_installed", False):
        return
    Scheduler._kv_eviction_installed = True

    # --- allocation by physical length -------------------------------------------------------
    original_count = SingleTypeKVCacheManager.get_num_blocks_to_allocate
    original_allocate = SingleTypeKVCacheManager.allocate_new_blocks

    @functools.wraps(original_count)
    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs):
        return original_count(self, request_id, _physical(self, request_id, num_tokens), *args, **kwargs)

    @functools.wraps(original_allocate)
    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return original_allocate(
            self, request_id, _physical(self, request_id, num_tokens),
            _physical(self, request_id, num_tokens_main_model),
        )

    SingleTypeKVCacheManager.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    SingleTypeKVCacheManager.allocate_new_blocks = allocate_new_blocks

    # --- freeing a request forgets its eviction state ----------------------------------------
    for name in ("free", "pop_blocks_for_free"):
        original = getattr(KVCacheManager, name)

        def forgetting(self, request, _original=original):
            ledger = getattr(self, "_kv_ledger", None)
            if ledger is not None and ledger.evicted.pop(request.request_id, 0) and not request.is_finished():
                ledger.preempted_after_eviction += 1
            return _original(self, request)

        setattr(KVCacheManager, name, functools.wraps(original)(forgetting))

    # --- scheduler: ledger, replay cap, counts to the worker, reports from it -----------------
    original_init = Scheduler.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        settings = settings_from(self.vllm_config)
        self.kv_ledger = Ledger(policy_name=settings.policy if settings else None)
        self.kv_ledger.pool_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # minus null block
        if settings is None:
            return
        check_compatible(self.vllm_config)
        build_policy(settings, self.cache_config.block_size)  # fail here, not at the first eviction
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
            raise ValueError(
                "KV eviction supports models with one full-attention KV cache group; this model has "
                f"{[type(m).__name__ for m in managers]}"
            )
        self.kv_cache_manager._kv_ledger = self.kv_ledger
        managers[0]._kv_evicted = self.kv_ledger.evicted

    original_lookahead = Scheduler._reserve_prefill_lookahead

    @functools.wraps(original_lookahead)
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = original_lookahead(self, request, num_computed_tokens, num_new_tokens)
        ledger = getattr(self, "kv_ledger", None)
        if ledger is None or ledger.policy_name is None:
            return num_new_tokens
        if num_computed_tokens < request.num_prompt_tokens:
            # A chunk never runs past the prompt: prefill eviction happens exactly at its end.
            return min(num_new_tokens, request.num_prompt_tokens - num_computed_tokens)
        # Past the prompt (a preempted request recomputing its outputs): one token per step, so
        # it meets the same decode evictions at the same lengths as it did the first time.
        return min(num_new_tokens, 1)

    original_schedule = Scheduler.schedule

    @functools.wraps(original_schedule)
    def schedule(self, *args, **kwargs):
        output = original_schedule(self, *args, **kwargs)
        ledger = getattr(self, "kv_ledger", None)
        if ledger is None:
            return output
        if ledger.evicted:
            output.kv_evicted_tokens = {
                rid: ledger.evicted[rid] for rid in output.num_scheduled_tokens if rid in ledger.evicted
            }
        if output.total_num_scheduled_tokens:
            used = ledger.pool_blocks - self.kv_cache_manager.block_pool.get_num_free_blocks()
            ledger.steps += 1
            ledger.used_blocks_sum += used
            ledger.used_blocks_peak = max(ledger.used_blocks_peak, used)
            ledger.running_peak = max(ledger.running_peak, len(self.running))
            held = self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
            for request in self.running:
                if request.num_computed_tokens > request.num_prompt_tokens:  # generating, not prefilling
                    ledger.decode_blocks_peak = max(ledger.decode_blocks_peak, len(held.get(request.request_id, ())))
        return output

    original_update = Scheduler.update_from_output

    @functools.wraps(original_update)
    def update_from_output(self, scheduler_output, model_runner_output):
        ledger = getattr(self, "kv_ledger", None)
        if ledger is not None:
            ledger.model_s += getattr(model_runner_output, "kv_model_s", 0.0)
            ledger.evict_s += getattr(model_runner_output, "kv_evict_s", 0.0)
            for request_id, eviction in (getattr(model_runner_output, "kv_evictions", None) or {}).items():
                release(self, ledger, request_id, eviction)
        return original_update(self, scheduler_output, model_runner_output)

    Scheduler._reserve_prefill_lookahead = _reserve_prefill_lookahead
    Scheduler.__init__ = __init__
    Scheduler.schedule = schedule
    Scheduler.update_from_output = update_from_output


def release(scheduler, ledger: Ledger, request_id: str, eviction) -> None:
    """Take the emptied blocks out of the request's block list and give them back to the pool."""
    request = scheduler.requests.get(request_id)
    if request is None or request.is_finished():
        return  # its blocks are being freed whole anyway
    manager = scheduler.kv_cache_manager
    blocks = manager.coordinator.single_type_managers[0].req_to_blocks[request_id]
    victims = [blocks.pop(position) for position in sorted(eviction.dropped_blocks, reverse=True)]
    manager.block_pool.free_blocks(victims)
    ledger.evicted[request_id] = ledger.evicted.get(request_id, 0) + eviction.evicted_tokens
    ledger.evictions[eviction.phase] += 1
    ledger.freed_blocks += len(victims)
    ledger.evicted_tokens += eviction.evicted_tokens
    ledger.copied_tokens[eviction.phase] += eviction.copied_tokens


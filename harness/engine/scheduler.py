"""Scheduler side of eviction (engine-core process): block accounting and freeing.

``EvictionScheduler`` is handed to vLLM through its own hook, ``scheduler_cls``
(``vllm/config/scheduler.py:177``, resolved in ``vllm/v1/engine/core.py:161``); nothing in vLLM's
``Scheduler`` class is replaced. It keeps a ledger of each request's *evicted token count* (logical
length minus physical length):

* allocation asks for blocks by the physical count (logical minus evicted), so blocks that were
  given back are never re-allocated to the request (the request's KV manager becomes a
  ``PhysicalLengthManager``, this scheduler's instance only);
* every ``SchedulerOutput`` carries an ``EvictionPlan`` (the counts, so the worker turns logical
  positions into physical slots), and every ``ModelRunnerOutput`` must carry the worker's
  ``EvictionReport``: the blocks it emptied leave the request's block list and go back to vLLM's
  pool at once; a missing report stops the engine (the worker is not evicting);
* freeing a request (finish, abort, preemption) forgets its count; a preempted request is then
  replayed one token per step after its prompt, so it meets the same evictions at the same steps.

The ledger also records what the memory claims rest on: blocks in use per step, concurrency,
evictions and their cost. With eviction off only those measurements run; vLLM decides as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from harness.engine.messages import (
    PLAN_ATTRIBUTE, REPORT_ATTRIBUTE, EvictionPlan, attach, required,
)
from harness.engine.settings import build_policy, check_compatible, settings_from

SCHEDULER_CLS = f"{__name__}.EvictionScheduler"


@dataclass
class Ledger:
    policy_name: str | None
    budget: int | None = None
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
        fresh = Ledger(self.policy_name, self.budget, evicted=self.evicted, pool_blocks=self.pool_blocks)
        self.__dict__.update(fresh.__dict__)

    def snapshot(self) -> dict:
        return {
            "policy": self.policy_name,
            "budget": self.budget,
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


class PhysicalLengthManager(FullAttentionManager):
    """A full-attention KV manager that sizes a request by its physical length.

    vLLM computes the blocks a request needs from its logical token count
    (``single_type_kv_cache_manager.py:175`` ``get_num_blocks_to_allocate`` and ``:369``
    ``allocate_new_blocks``); after an eviction that would re-allocate what was given back.
    """

    kv_evicted: dict[str, int]

    def _physical(self, request_id: str, num_tokens: int) -> int:
        return num_tokens - self.kv_evicted.get(request_id, 0)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs):
        return super().get_num_blocks_to_allocate(request_id, self._physical(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(
            request_id, self._physical(request_id, num_tokens), self._physical(request_id, num_tokens_main_model)
        )


class EvictionScheduler(Scheduler):
    """vLLM's scheduler plus the eviction ledger; decides exactly as vLLM's when eviction is off.

    Synchronous by design: a step's evictions must reach the next ``schedule()`` (vLLM warns
    that a ``Scheduler`` subclass disables asynchronous scheduling; eviction requires that)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_settings = settings_from(self.vllm_config)
        settings = self.kv_settings
        self.kv_ledger = Ledger(settings.policy if settings else None, settings.budget if settings else None)
        self.kv_ledger.pool_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # minus null block
        self.kv_released: set[str] = set()  # freed since the last plan
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
        managers[0].__class__ = PhysicalLengthManager  # this engine's manager only, same state
        managers[0].kv_evicted = self.kv_ledger.evicted

    def kv_eviction_state(self, reset: bool = False) -> dict:
        """What the harness reads back (in-process or through an engine-core utility call): the
        settings this scheduler runs, its ledger, and the pool's free blocks."""
        if reset:
            self.kv_ledger.reset_measurements()
        settings = self.kv_settings
        return {
            "settings": {"policy": settings.policy, "budget": settings.budget, "options": dict(settings.options)}
            if settings else None,
            "ledger": self.kv_ledger.snapshot(),
            "free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
        }

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self.kv_settings is None:
            return num_new_tokens
        if num_computed_tokens < request.num_prompt_tokens:
            # A chunk never runs past the prompt: prefill eviction happens exactly at its end.
            return min(num_new_tokens, request.num_prompt_tokens - num_computed_tokens)
        # Past the prompt (a preempted request recomputing its outputs): one token per step, so
        # it meets the same decode evictions at the same lengths as it did the first time.
        return min(num_new_tokens, 1)

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        ledger = self.kv_ledger
        if self.kv_settings is not None:
            evicted = {rid: ledger.evicted[rid] for rid in output.num_scheduled_tokens if rid in ledger.evicted}
            released, self.kv_released = tuple(sorted(self.kv_released)), set()
            attach(output, PLAN_ATTRIBUTE, EvictionPlan(self.kv_settings.policy, self.kv_settings.budget, evicted, released))
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

    def update_from_output(self, scheduler_output, model_runner_output):
        settings = self.kv_settings
        if settings is not None and model_runner_output.req_ids:
            report = required(
                model_runner_output, REPORT_ATTRIBUTE, (settings.policy, settings.budget), "worker",
                "its model runner is not patched (the kv_eviction vLLM plugin did not load in the worker "
                "process; check VLLM_PLUGINS and that the harness is installed in this environment)",
            )
            ledger = self.kv_ledger
            ledger.model_s += report.model_s
            ledger.evict_s += report.evict_s
            for request_id, eviction in report.evictions.items():
                self._release(request_id, eviction)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_request_blocks(self, request):
        # Every way a request lets go of its blocks (finish, abort, preemption) passes here
        # (vllm/v1/core/sched/scheduler.py:2766, from _free_blocks and _preempt_request): its
        # evicted count goes with them.
        ledger = self.kv_ledger
        if ledger.evicted.pop(request.request_id, 0) and not request.is_finished():
            ledger.preempted_after_eviction += 1
        if self.kv_settings is not None:
            self.kv_released.add(request.request_id)
        super()._free_request_blocks(request)

    def _release(self, request_id: str, eviction) -> None:
        """Take the emptied blocks out of the request's block list and give them back to the pool."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished():
            return  # its blocks are being freed whole anyway
        ledger = self.kv_ledger
        blocks = self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[request_id]
        victims = [blocks.pop(position) for position in sorted(eviction.dropped_blocks, reverse=True)]
        self.kv_cache_manager.block_pool.free_blocks(victims)
        ledger.evicted[request_id] = ledger.evicted.get(request_id, 0) + eviction.evicted_tokens
        ledger.evictions[eviction.phase] += 1
        ledger.freed_blocks += len(victims)
        ledger.evicted_tokens += eviction.evicted_tokens
        ledger.copied_tokens[eviction.phase] += eviction.copied_tokens

"""Scheduler side of eviction (engine-core process): per-request settings, block accounting,
freeing, and eviction under prefix caching.

``EvictionScheduler`` is handed to vLLM through its own hook, ``scheduler_cls``
(``vllm/config/scheduler.py:177``, resolved in ``vllm/v1/engine/core.py:161``); nothing in vLLM's
``Scheduler`` class is replaced. Each request evicts by its own settings
(``SamplingParams.extra_args["kv_eviction"]``, else the engine's ``additional_config`` default,
else not at all), so different policies and budgets run side by side in one batch. It keeps a
ledger of each request's *evicted token count* (logical length minus physical length):

* allocation asks for blocks by the physical count (logical minus evicted), so blocks that were
  given back are never re-allocated to the request (the request's KV manager becomes a
  ``PhysicalLengthManager``, this scheduler's instance only);
* every ``SchedulerOutput`` carries an ``EvictionPlan`` (settings and counts, so the worker knows
  who evicts and turns logical positions into physical slots), and a step that ran an evicting
  request must come back with the worker's ``EvictionReport``: the request's block list takes its
  new shape and the released blocks go back to vLLM's pool at once; a missing report stops the
  engine (the worker is not evicting);
* how many tokens and blocks an eviction leaves is fixed by the policy and the request's length
  (only *which* ones depends on scores), so the plan that schedules an eviction already counts its
  tokens as evicted (``Expected``), and the report is checked against that. The next plan is then
  right whether the report came first (synchronous scheduling) or comes one step late
  (``AsyncEvictionScheduler``: vLLM plans step N+1 before step N's output is back). Compaction
  keeps the first blocks, so that plan releases the rest at once; a block policy's victim,
  chosen by scores, is held until the report names it, and blocks allocated meanwhile follow
  the kept ones;
* freeing a request (finish, abort, preemption) forgets its count; a preempted request is then
  replayed one token per step after its prompt, so it meets the same evictions at the same steps;
* a request at a measured schedule (``budget_schedule=attention``, or ``kvzip``: from KVzip's
  reconstruction scores) has its layer groups'
  budgets measured by the worker in the step that reaches its eviction point, which also evicts
  by them: that plan cannot count the eviction (``Undecided``), so the step's report brings the
  budgets and the scheduler counts and reshapes from them before it plans again. That needs the
  report before the next plan: synchronous scheduling only (refused otherwise, as is prefix
  caching's sharing for such a request: its copies could not be allocated before its budgets
  are known);
* a request compressing its context alone (``compress=context``) runs its prefill eviction at
  its context boundary instead of its prompt's end (``eviction_point``): its chunk ends there, the
  eviction's count is fixed by the policy and the context's length as above (so asynchronous
  plans count it the same way), and the question's tokens are then scheduled like any prefill;
* a hybrid model (sliding-window layers beside full-attention ones, Gemma 3) gets several KV cache
  groups from vLLM: eviction acts on the full-attention groups only (their managers become
  ``PhysicalLengthManager``s, the budget counts their layers); each sliding-window group keeps
  vLLM's ``SlidingWindowManager``, its evicted count stays 0 and vLLM frees what leaves its window
  (``harness.engine.layer_groups.policies_by_group``). What is not built for it yet (layer groups,
  measured schedules, KVzip, shared compressed contexts and chains) is refused in one line;
* a request with ``chain=true`` (a turn of a conversation) takes the previous turn's whole kept
  cache as a hit (``harness.engine.shared_contexts``: published when that turn finished) and runs its
  prefill eviction at its own context boundary on that cache plus its new tokens; the plan that
  schedules that eviction lets the entry go, so the turn holds the history once.

With prefix caching on, eviction never writes a block the prefix cache may hand to someone else:
* a step that compacts a request allocates, inside vLLM's own ``allocate_slots`` (so admission
  and preemption count them), one fresh block per target block that is registered in the cache
  or shared; compaction writes those instead (``EvictionPlan.copy_targets``), they take the
  targets' places in the request's block list, and the pristine blocks are released, still
  cached, for the next request with the same prompt;
* a request's blocks are registered only until its first eviction (after it, its physical blocks
  no longer hold what their logical hashes describe);
* a replayed (preempted) evicting request takes cache hits only inside its prompt, so its prefill
  eviction runs again at the prompt's end; an attention-aware one leaves its window of prompt
  queries to be computed.

The ledger also records what the memory claims rest on: blocks in use per step, concurrency,
evictions and their cost, engine-wide and per request. With eviction off only those measurements
run; vLLM decides as before.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from harness.engine import patches
from harness.eviction.counters import EvictionCounters, RequestCounters
from harness.eviction.evictor import cdiv, compaction_positions, kept_tokens, phase_due
from harness.eviction.messages import (
    PLAN_ATTRIBUTE, REPORT_ATTRIBUTE, EvictionNotActiveError, EvictionPlan, required,
)
from harness.engine.compatibility import (REFUSED, check_compatible, layer_groups_of, prefix_cache_refusal,
                                         prefix_cache_unreachable)
from harness.engine.context_sharing import ContextSharing
from harness.engine.layer_groups import evicting, hybrid_reason, policies_by_group
from harness.engine.shared_contexts import ContextCache, ContextStats, context_key
from harness.eviction.settings import (EvictionSettings, build_policy, request_settings, settings_from,
                                       unshareable)
from policies import BlockPolicy, Policy


@dataclass
class Ledger:
    """The engine's own figures (pool, steps, peaks, the worker's time) beside the sum of every
    request's eviction counters (``totals``)."""

    policy_name: str | None
    budget: int | None = None
    # live requests' evicted tokens, one count per KV cache group (state)
    evicted: dict[str, list[int]] = field(default_factory=dict)
    pool_blocks: int = 0
    steps: int = 0
    used_blocks_sum: int = 0
    used_blocks_peak: int = 0
    running_peak: int = 0
    decode_blocks_peak: int = 0  # most blocks any request held while generating (every group's)
    groups: int = 1  # KV cache groups (engine.layer_groups)
    # With several groups: per group, the most blocks an evicting request held there while generating
    # (each group evicts by its own budget).
    evicting_group_blocks_peak: list[int] = field(default_factory=list)
    totals: EvictionCounters = field(default_factory=EvictionCounters)
    # The worker's time per step (report): eviction work including query counting outside evictions,
    # the model, and the query-window copy inside the model's time.
    evict_s: float = 0.0
    model_s: float = 0.0
    capture_s: float = 0.0
    # KVzip's reconstruction passes (inside evict_s: the eviction's share counts them), their tokens,
    # and the contexts that took an earlier request's scores instead (harness.engine.reconstruction)
    reconstruct_s: float = 0.0
    reconstruct_tokens: int = 0
    reconstruct_reused: int = 0
    state_bytes_peak: int = 0      # per-request policy state held by the worker (scores, windows)
    # the compressed-context cache's figures (``harness.engine.shared_contexts``), where it runs
    contexts: ContextStats | None = None

    def reset_measurements(self) -> None:
        """Start counting afresh (between repeats of a benchmark on one engine); the live
        requests' evicted counts are state, not measurements, and stay."""
        fresh = Ledger(self.policy_name, self.budget, evicted=self.evicted, pool_blocks=self.pool_blocks,
                       groups=self.groups, contexts=self.contexts)
        self.__dict__.update(fresh.__dict__)
        if self.contexts is not None:  # the cache's own figures, reset where it keeps them
            self.contexts.__dict__.update(ContextStats().__dict__)

    def add_step(self, report) -> None:
        """The worker's time and policy state of one step that ran an evicting request (its
        ``EvictionReport``)."""
        self.model_s += report.model_s
        self.evict_s += report.evict_s
        self.capture_s += report.capture_s
        self.reconstruct_s += report.reconstruct_s
        self.reconstruct_tokens += report.reconstruct_tokens
        self.reconstruct_reused += report.reconstruct_reused
        self.state_bytes_peak = max(self.state_bytes_peak, report.state_bytes)

    def snapshot(self) -> dict:
        """The ledger as ``perf.json``'s ``kv`` record holds it (``harness.records.perf.kv_memory``
        adds bytes): the engine's figures, its requests' counters (``EvictionCounters.counts``),
        the worker's time."""
        return {
            "policy": self.policy_name,
            "budget": self.budget,
            "kv_pool_blocks": self.pool_blocks,
            "steps": self.steps,
            "kv_blocks_used_peak": self.used_blocks_peak,
            "kv_blocks_used_mean": self.used_blocks_sum / self.steps if self.steps else 0.0,
            "running_requests_peak": self.running_peak,
            "decode_blocks_peak": self.decode_blocks_peak,
            **self.totals.counts(),
            # In the counters' place: the worker's eviction time per step, which includes counting
            # queries outside any eviction (the counters sum the evictions' own times).
            "evict_s": self.evict_s,
            "model_s": self.model_s,
            "evict_share_of_step": self.evict_s / self.model_s if self.model_s else 0.0,
            "capture_s": self.capture_s,
            "capture_share_of_step": self.capture_s / self.model_s if self.model_s else 0.0,
            "policy_state_bytes_peak": self.state_bytes_peak,
            # only where a reconstructing policy (KVzip) ran, so that other records keep their keys
            **({"reconstruct_s": self.reconstruct_s, "reconstruct_tokens": self.reconstruct_tokens,
                "reconstruct_reused": self.reconstruct_reused}
               if self.reconstruct_tokens or self.reconstruct_reused else {}),
            # only with several groups, so that one group's records keep their keys
            **({"kv_cache_groups": self.groups, "evicting_group_blocks_peak": self.evicting_group_blocks_peak}
               if self.groups > 1 else {}),
            # only where a context was shared or compressed to be, so that other records keep their keys
            **({"shared_contexts": self.contexts.as_dict()}
               if self.contexts is not None and (self.contexts.published or self.contexts.hits
                                                 or self.contexts.chain_published) else {}),
        }


KEPT_REQUEST_COUNTERS = 100_000  # finished requests' stats kept for the harness (oldest dropped)


@dataclass(frozen=True)
class Expected:
    """An eviction a plan scheduled, as the policy fixes it before any score is read: the tokens
    it evicts, the blocks it starts from (the request's own ``source_blocks``, then ``copies``
    copy targets) and the positions of those it keeps. Compaction keeps the first blocks (a copy
    target in place of the block it stands for: ``harness.eviction.evictor.evict_group``), so the
    plan that schedules it already knows them and gives the rest back; a block policy's decode
    eviction drops one block its scores choose (``kept`` is None), which the request holds, as
    its one ``surplus`` block, until the report names it."""

    step: int
    evicted_tokens: int
    source_blocks: int
    copies: int
    kept: tuple[int, ...] | None

    @property
    def surplus(self) -> int:
        return 1 if self.kept is None else 0

    def matches(self, eviction) -> bool:
        kept = eviction.kept_blocks if self.kept is not None else len(eviction.kept_blocks)
        return (eviction.evicted_tokens, eviction.held_blocks, kept) == (
            self.evicted_tokens, self.source_blocks + self.copies,
            self.kept if self.kept is not None else self.source_blocks - 1)


@dataclass(frozen=True)
class Undecided:
    """The prefill eviction of a request at a measured schedule (attention, kvzip), in the step that measures its
    group budgets: what it leaves is known when the report brings them (``tokens``: the physical
    tokens it starts from). Synchronous scheduling only, so no plan is made before then."""

    step: int
    tokens: int
    surplus = 0


def expected_eviction(policy: Policy, phase: str, tokens: int, copy_positions: tuple[int, ...], step: int) -> Expected:
    """What an eviction of ``tokens`` physical tokens will leave: a block policy's decode eviction
    drops one block; otherwise the policy keeps ``prefill_keep_count`` after prefill and its
    budget in decode, compacted into the first blocks."""
    blocks = cdiv(tokens, policy.block_size)
    if phase == "decode" and isinstance(policy, BlockPolicy):
        return Expected(step, policy.block_size, blocks, 0, None)
    kept = kept_tokens(policy, phase, tokens)
    positions = compaction_positions(blocks, copy_positions)
    return Expected(step, tokens - kept, blocks, len(copy_positions), tuple(positions[: cdiv(kept, policy.block_size)]))


class PhysicalLengthManager(FullAttentionManager):
    """A full-attention KV manager that sizes a request by its physical length.

    vLLM computes the blocks a request needs from its logical token count
    (``single_type_kv_cache_manager.py:175`` ``get_num_blocks_to_allocate`` and ``:369``
    ``allocate_new_blocks``); after an eviction that would re-allocate what was given back. A
    block policy's victim, held until the report names it (one step late under asynchronous
    scheduling), counts as filled: vLLM's arithmetic (needed minus held) then asks for what the
    request needs after the eviction.
    """

    kv_scheduler: "EvictionScheduler"
    kv_group: int  # its KV cache group (several with engine.layer_groups: each its own count)

    def _physical(self, request_id: str, num_tokens: int) -> int:
        expected = self.kv_scheduler.kv_expected.get((request_id, self.kv_group))
        surplus = expected.surplus * self.block_size if expected is not None else 0
        return num_tokens - self.kv_scheduler.evicted(request_id, self.kv_group) + surplus

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, *args, apply_admission_cap: bool = False, **kwargs):
        if apply_admission_cap:
            # vLLM's admission gate: can the whole sequence fit (vllm/v1/core/kv_cache_manager.py:522-538,
            # sched/scheduler.py:3060-3076)? An evicting request never holds more than its peak.
            num_tokens = self.kv_scheduler.peak_tokens(request_id, num_tokens, self.kv_group)
        if new_computed_blocks:
            # A shared compressed context (its blocks hold fewer tokens than it stands for): whether its
            # last block is partial, and so copied (single_type_kv_cache_manager.py:163-173, 261-264),
            # is decided by the tokens the blocks hold.
            num_local_computed_tokens = self._physical(request_id, num_local_computed_tokens)
        blocks = super().get_num_blocks_to_allocate(
            request_id, self._physical(request_id, num_tokens), new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, *args, apply_admission_cap=apply_admission_cap, **kwargs)
        return blocks + len(self.kv_scheduler.copy_targets(request_id, num_tokens, self.kv_group))

    def add_local_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                  num_external_computed_tokens):
        # as above: a partial last block of a shared compressed context is copied before the
        # request's question is written into it (single_type_kv_cache_manager.py:318-324, 388-397)
        super().add_local_computed_blocks(request_id, new_computed_blocks,
                                          self._physical(request_id, num_local_computed_tokens),
                                          num_external_computed_tokens)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        blocks = super().allocate_new_blocks(
            request_id, self._physical(request_id, num_tokens), self._physical(request_id, num_tokens_main_model)
        )
        targets = self.kv_scheduler.copy_targets(request_id, num_tokens, self.kv_group)
        if targets:
            # Counted above, so vLLM's admission check covered them. They stay out of the request's
            # block list (whose row in the worker's block table holds max_model_len's blocks at
            # most) until the eviction makes them part of it.
            self.kv_scheduler.kv_planned_targets[(request_id, self.kv_group)] = (
                targets, self.block_pool.get_new_blocks(len(targets)))
        return blocks

    def cache_blocks(self, request, *args, **kwargs):
        # After its first eviction a request's physical blocks no longer hold what the logical
        # block hashes describe: nothing more of it is registered (single_type_kv_cache_manager.py:476),
        # in any group (a prefix hit must hold in every group: kv_cache_coordinator.py:796-931).
        if any(self.kv_scheduler.kv_ledger.evicted.get(request.request_id, ())) or \
                request.request_id in self.kv_scheduler.kv_uncached:
            return
        super().cache_blocks(request, *args, **kwargs)


class EvictionScheduler(Scheduler):
    """vLLM's scheduler plus per-request eviction; decides exactly as vLLM's when no request evicts.

    One name serves both of vLLM's scheduling modes: vLLM keeps a user's ``scheduler_cls`` as given
    and decides asynchronous scheduling by itself (``vllm/config/scheduler.py:228-253``,
    ``vllm/config/vllm.py:1585-1644``; on by default on GPUs, forced off on CPU by
    ``vllm/platforms/cpu.py:329-331``), so an engine that ends up asynchronous gets
    ``AsyncEvictionScheduler``, the same on vLLM's ``AsyncScheduler``."""

    def __new__(cls, *args, **kwargs):
        config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is EvictionScheduler and config is not None and config.scheduler_config.async_scheduling:
            cls = AsyncEvictionScheduler
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_settings = settings_from(self.vllm_config)  # the engine-wide default
        self.kv_block_size = self.cache_config.block_size
        default = self.kv_settings
        self.kv_ledger = Ledger(default.policy if default else None, default.budget if default else None)
        self.kv_ledger.pool_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # minus null block
        self.kv_ledger.groups = len(self.kv_cache_manager.coordinator.single_type_managers)
        self.kv_request_settings: dict[str, EvictionSettings] = {}  # live requests that evict
        self.kv_request_counters: OrderedDict[str, RequestCounters] = OrderedDict()
        self.kv_whole_policies: dict[tuple, Policy] = {}
        # Per (request, KV cache group): one group, or G with engine.layer_groups, each its own
        # block list, evicted count and budget (harness.engine.layer_groups).
        managers = self.kv_cache_manager.coordinator.single_type_managers
        self.kv_groups = len(managers)
        # vLLM's Scheduler keeps the engine's KV cache config (vllm/v1/core/sched/scheduler.py:101):
        # each group's spec and layers, in the managers' order (kv_cache_coordinator.py:1024-1038).
        self.kv_group_specs = [(group.kv_cache_spec, len(group.layer_names))
                               for group in self.kv_cache_config.kv_cache_groups]
        # The groups eviction acts on: all of them, or a hybrid model's full-attention ones; its
        # sliding-window groups stay vLLM's (harness.engine.layer_groups: evicted count 0, never reshaped).
        self.kv_evicting = tuple(g for g, (spec, _) in enumerate(self.kv_group_specs) if evicting(spec))
        self.kv_hybrid = len(self.kv_evicting) != self.kv_groups
        # Copy targets allocated by this schedule() (positions, blocks), then held for its step.
        self.kv_planned_targets: dict[tuple[str, int], tuple[tuple[int, ...], list]] = {}
        self.kv_expected: dict[tuple[str, int], Expected | Undecided] = {}  # scheduled evictions not reported yet
        self.kv_abandoned: set[tuple[str, int, int]] = set()  # (request, group, step): freed before its report came
        self.kv_step = 0
        # Evicting requests kept out of the prefix cache: their copies could not fit in the pool.
        self.kv_uncached: set[str] = set()
        self.kv_released: set[str] = set()  # freed since the last plan
        self.kv_unsupported = self._unsupported_reason()
        # Compressed contexts shared between requests (harness.engine.shared_contexts): where vLLM
        # adopts cached blocks at all (prefix caching on: single_type_kv_cache_manager.py:298-304)
        # and no KV connector would take a compressed hit for a pristine one.
        self.kv_contexts = ContextCache(self.kv_cache_manager.block_pool) if self._shares_contexts() else None
        self.kv_ledger.contexts = self.kv_contexts.stats if self.kv_contexts is not None else None
        # who takes, compresses, waits for and publishes them (harness.engine.context_sharing)
        self.kv_sharing = ContextSharing(self, self.kv_contexts) if self.kv_contexts is not None else None
        self.kv_refused: list[tuple] = []  # (request, message): refused on arrival, reported with the next output
        self.kv_prefix_cache_resets = 0  # told to the workers in every plan (their kept reconstruction scores)
        if self.kv_unsupported is None:
            for group, manager in enumerate(managers):
                if group not in self.kv_evicting:
                    continue  # a sliding-window group: vLLM's SlidingWindowManager as it is
                patches.swap_class(manager, PhysicalLengthManager)  # this engine's managers only, same state
                patches.set_on(manager, "kv_scheduler", self)
                patches.set_on(manager, "kv_group", group)
            self._cap_replayed_cache_hits()
        if default is not None:
            if self.kv_unsupported is not None:
                raise ValueError(self.kv_unsupported)
            self.group_policies(default)  # fail here, not at the first eviction

    def _unsupported_reason(self) -> str | None:
        try:
            check_compatible(self.vllm_config)
        except ValueError as error:
            return str(error)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        specs = [spec for spec, _ in self.kv_group_specs]
        reason = hybrid_reason(self.vllm_config, specs)
        if reason is not None:
            return reason
        # Full-attention groups: one, or the engine's layer groups (harness.engine.layer_groups); beside
        # them, a hybrid model's sliding-window groups, each vLLM's own manager (the exact classes: a
        # subclass could free or keep blocks otherwise).
        wanted = [FullAttentionManager if evicting(spec) else SlidingWindowManager for spec in specs]
        if len(self.kv_evicting) != layer_groups_of(self.vllm_config) or \
                any(type(m) is not kind for m, kind in zip(managers, wanted)):
            return ("KV eviction supports full-attention KV cache groups (one, or engine.layer_groups of them), "
                    f"beside sliding-window ones; this engine has {[type(m).__name__ for m in managers]}")
        return None

    def _shares_contexts(self) -> bool:
        # (not on a hybrid model: an entry would have to hold each sliding-window group's window,
        # harness.eviction.admission.hybrid_refusal)
        return self.kv_unsupported is None and bool(self.cache_config.enable_prefix_caching) and \
            self.connector is None and not self.kv_hybrid

    def unshared_reason(self, request, settings: EvictionSettings) -> str | None:
        """Why this request's compressed context is not shared (None: it is)."""
        if settings.share_context is False:
            return "share_context=false"
        if self.kv_hybrid:
            return "the model has sliding-window layers"
        return unshareable(settings.compress, settings.budget_schedule) or self._prefix_cache_unreachable(request)

    def _prefix_cache_unreachable(self, request) -> str | None:
        """Why shared contexts and chain entries cannot reach ``request`` here (the frontend's words:
        ``harness.engine.compatibility.prefix_cache_unreachable``)."""
        if self.kv_contexts is not None and not request.skip_reading_prefix_cache:
            return None
        return prefix_cache_unreachable(prefix_caching=bool(self.cache_config.enable_prefix_caching),
                                        connector=self.connector is not None,
                                        skips_prefix_cache=bool(request.skip_reading_prefix_cache))

    def policy_for(self, settings: EvictionSettings) -> Policy:
        """The policy of the settings' whole budget (what is the same in every group: its kind,
        window, phases); each group's own budget is ``group_policy``'s."""
        policy = self.kv_whole_policies.get(settings.key)
        if policy is None:
            policy = self.group_policy(settings, self.kv_evicting[0]) if len(self.kv_evicting) == 1 \
                else build_policy(settings, self.kv_block_size)
            self.kv_whole_policies[settings.key] = policy
        return policy

    def group_policies(self, settings: EvictionSettings) -> tuple[Policy, ...]:
        """Each KV cache group's policy (a hybrid model's sliding-window groups: ``FullCache``)."""
        return policies_by_group(settings, self.kv_block_size, self.kv_group_specs,
                                 enforce_eager=self.vllm_config.model_config.enforce_eager,
                                 async_scheduling=isinstance(self, AsyncScheduler))

    def group_policy(self, settings: EvictionSettings, group: int) -> Policy:
        return self.group_policies(settings)[group]

    def evicted(self, request_id: str, group: int) -> int:
        """A request's evicted tokens in one KV cache group (logical minus physical length)."""
        counts = self.kv_ledger.evicted.get(request_id)
        return counts[group] if counts else 0

    def add_request(self, request) -> None:
        # The frontend refuses what cannot run with HTTP 400 (``harness.engine.frontend.check_request``);
        # this is the backstop, for a frontend without the plugin, and it never raises: an exception
        # here leaves vLLM's engine core (``EngineCore.add_request``, vllm/v1/engine/core.py:508-548,
        # runs in its busy loop) and stops the engine. A request refused here ends with an error and
        # the reason (``REFUSED``), like one whose policy failed.
        try:
            admitted = self._admit(request)
        except Exception as error:  # noqa: BLE001 - a user's policy may raise anything when built
            super().add_request(request)
            text = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            for ended in self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR):
                self.kv_refused.append((ended, f"{REFUSED}{text}"))
            return
        if admitted is not None:
            settings, uncached, key = admitted
            self.kv_request_settings[request.request_id] = settings
            self._counters(request.request_id, settings)
            if uncached:
                self.kv_uncached.add(request.request_id)
            if key is not None:
                self.kv_sharing.admit(request.request_id, key)
        super().add_request(request)

    def _admit(self, request) -> tuple[EvictionSettings, bool, tuple | None] | None:
        """A request's settings as it will run (None: it keeps its whole cache), whether it stays out
        of the prefix cache, and its context's key where it may share one; ``ValueError`` where this
        engine cannot run them. Changes nothing: the caller records what it returns."""
        params = request.sampling_params
        settings = request_settings(params.extra_args if params else None, self.kv_settings, self.kv_block_size)
        if settings is None:
            return None
        # A budget_ratio becomes this request's token budget; the worker gets it in the plan.
        settings = settings.for_prompt(request.num_prompt_tokens, self.kv_block_size)
        if self.kv_unsupported is not None:
            raise ValueError(f"request {request.request_id} asks for KV eviction: {self.kv_unsupported}")
        self.group_policies(settings)
        refusal = prefix_cache_refusal(settings, prefix_caching=bool(self.cache_config.enable_prefix_caching),
                                       connector=self.connector is not None,
                                       skips_prefix_cache=bool(request.skip_reading_prefix_cache))
        if refusal is not None:
            raise ValueError(f"request {request.request_id}: {refusal}")
        unshared = self.unshared_reason(request, settings) if settings.compress == "context" else None
        if unshared is not None and settings.share_context:
            raise ValueError(f"request {request.request_id}: share_context=true, but {unshared}")
        uncached = bool(self.cache_config.enable_prefix_caching) and (
            settings.measuring or not self._copies_fit(request, settings))
        key = context_key(request, settings, self.kv_cache_manager.block_pool.hash_block_size) \
            if settings.compress == "context" and unshared is None else None
        return settings, uncached, key

    def _copies_fit(self, request, settings: EvictionSettings) -> bool:
        """Whether the pool can ever hold this request's blocks plus the copies its evictions
        need (after prefill: the prompt and its kept tokens; in decode: budget + block and the
        budget again). A request for which it cannot never takes or leaves anything in the
        prefix cache, so it compacts in place, like an engine without prefix caching; otherwise
        it would wait, or preempt itself, forever. Every group's blocks count (each its own budget;
        a sliding-window group what vLLM admits it with, kv_cache_interface.py:859-885)."""
        blocks = self.kv_block_size
        prompt = settings.eviction_point(request.num_prompt_tokens)
        need = 0
        for group, policy in enumerate(self.group_policies(settings)):
            if group not in self.kv_evicting:
                need += self.kv_group_specs[group][0].max_admission_blocks_per_request(
                    self.vllm_config.max_in_flight_tokens, self.vllm_config.model_config.max_model_len)
                continue
            need += max(cdiv(prompt, blocks) + cdiv(policy.prefill_keep_count(prompt), blocks),
                        cdiv(policy.budget + blocks, blocks) + cdiv(policy.budget, blocks))
        capacity = self.kv_ledger.pool_blocks - self.kv_cache_manager.watermark_blocks
        return need <= capacity

    def _counters(self, request_id: str, settings: EvictionSettings) -> RequestCounters:
        counters = self.kv_request_counters.get(request_id)
        if counters is None:
            counters = self.kv_request_counters[request_id] = RequestCounters(policy=settings.policy, budget=settings.budget)
            while len(self.kv_request_counters) > KEPT_REQUEST_COUNTERS:
                self.kv_request_counters.popitem(last=False)
        return counters

    def _cap_replayed_cache_hits(self) -> None:
        """An evicting request takes cache hits only where its own computation is not needed: its
        prompt's last token runs (vLLM caps hits at ``num_tokens - 1`` only,
        ``vllm/v1/core/kv_cache_manager.py:264``, so a replayed, preempted request could hit past
        its prompt), so its prefill eviction runs again at the prompt's end and its later
        evictions at the same lengths; and an attention-aware policy's window of prompt queries
        is computed, not read from the cache (a cache holds keys and values, not queries)."""
        manager = self.kv_cache_manager
        find = manager.get_computed_blocks

        def get_computed_blocks(request):
            shared = self.kv_sharing.take(request) if self.kv_sharing is not None else None
            if shared is not None:
                return shared
            if request.request_id in self.kv_uncached:
                return manager.empty_kv_cache_blocks, 0, 0
            blocks, hit, boundary = find(request)
            settings = self.kv_request_settings.get(request.request_id)
            if settings is None:
                return blocks, hit, boundary
            limit = self.eviction_point(request) - max(1, self.policy_for(settings).query_window)
            if hit <= limit:
                return blocks, hit, boundary
            if self.kv_hybrid:
                # A sliding-window group's hit holds real blocks only for the window before the hit's
                # end, null blocks before it (find_longest_cache_hit, single_type_kv_cache_manager.py:956-1010);
                # cut shorter, its window would be null blocks. The request computes its prompt instead.
                return manager.empty_kv_cache_blocks, 0, 0
            keep = max(limit, 0) // self.kv_block_size
            capped = manager.create_kv_cache_blocks(tuple(list(group[:keep]) for group in blocks.blocks))
            return capped, keep * self.kv_block_size, 0

        patches.set_on(manager, "get_computed_blocks", get_computed_blocks)

    def _handle_blocked_waiting_request(self, request) -> bool:
        """A request whose context another request is compressing now waits for it (skipped this
        step, keeping its place: vllm/v1/core/sched/scheduler.py:904-910, 929-931; ``ContextSharing.ready``)."""
        ready = super()._handle_blocked_waiting_request(request)
        return ready and (self.kv_sharing is None or self.kv_sharing.ready(request))

    def eviction_point(self, request) -> int:
        """Where an evicting request's prefill eviction runs: the end of its prompt, or of its
        context under ``compress=context``."""
        return self.kv_request_settings[request.request_id].eviction_point(request.num_prompt_tokens)

    def peak_tokens(self, request_id: str, num_tokens: int, group: int = 0) -> int:
        """The most tokens a request of ``num_tokens`` logical tokens holds at once, as its
        evictions leave it: its whole prompt (or context) at the eviction point, then what prefill
        eviction kept plus the tokens after it, which decode eviction holds to one block past the
        budget. A preempted request that replays many outputs would otherwise never pass vLLM's
        admission gate. (Per KV cache group: each its own budget.)"""
        settings = self.kv_request_settings.get(request_id)
        request = self.requests.get(request_id)
        if settings is None or request is None or settings.measuring or any(self.kv_ledger.evicted.get(request_id, ())):
            return num_tokens  # (a measured schedule not measured yet: as if it never evicted)
        policy = self.group_policy(settings, group)
        prompt = self.eviction_point(request)
        if num_tokens <= prompt or not policy.evicts:
            return num_tokens
        after = num_tokens - prompt + (policy.prefill_keep_count(prompt) if policy.needs_prefill_eviction(prompt) else prompt)
        if policy.decode_eviction:
            after = min(after, max(policy.budget + self.kv_block_size, policy.prefill_keep_count(prompt)))
        return min(num_tokens, max(prompt, after))

    def copy_targets(self, request_id: str, num_tokens: int, group: int = 0) -> tuple[int, ...]:
        """Positions of the blocks a compaction due when this request reaches ``num_tokens``
        tokens would write but must not: registered in the prefix cache (or to be registered
        by this very allocation: ``allocate_slots`` caches the step's full blocks) or shared."""
        settings = self.kv_request_settings.get(request_id)
        request = self.requests.get(request_id)
        taking = self.kv_sharing.taking.get(request_id) if self.kv_sharing is not None else None
        if settings is None or request is None or not self.cache_config.enable_prefix_caching or \
                request_id in self.kv_uncached or (taking is not None and not taking.chain):
            return ()  # (a request taking a compressed context: its prefill eviction is the context's, done)
        policy = self.group_policy(settings, group)
        evicted = self.evicted(request_id, group)
        # A request taking a chain entry is still waiting: vLLM sets its computed tokens after this
        # allocation (vllm/v1/core/sched/scheduler.py:1369), so they are the entry's length here.
        before = taking.length if taking is not None else request.num_computed_tokens
        phase = phase_due(policy, self.eviction_point(request), before, num_tokens, evicted)
        if phase is None or (phase == "decode" and isinstance(policy, BlockPolicy)):
            return ()  # nothing written (a block eviction only drops a block)
        kept = kept_tokens(policy, phase, num_tokens - evicted)  # of the physical tokens it holds then
        if phase == "prefill" and kept == num_tokens - evicted:
            return ()
        if taking is not None:
            # Every position the entry's blocks hold is shared (the cache's reference and this
            # request's), the copied partial last block too until its copy has run
            # (single_type_kv_cache_manager.py:454-473 takes an extra reference): the same count
            # whether vLLM asks before adding the hit (get_num_blocks_to_allocate,
            # kv_cache_manager.py:522-538) or after (allocate_new_blocks).
            return tuple(range(min(cdiv(kept, self.kv_block_size), len(taking.blocks[group]))))
        registering = num_tokens // self.kv_block_size if not evicted else 0
        held = self.kv_cache_manager.coordinator.single_type_managers[group].req_to_blocks.get(request_id, [])
        return tuple(
            position for position in range(cdiv(kept, self.kv_block_size))
            if position < registering or (position < len(held) and (
                held[position].block_hash is not None or held[position].ref_cnt > 1))
        )

    def kv_eviction_state(self, reset: bool = False, requests: list[str] | None = None) -> dict:
        """What the harness reads back (in-process or through an engine-core utility call): the
        default settings this scheduler runs, its ledger, the pool's free blocks, and the
        per-request stats of ``requests`` (handed over once: they leave the scheduler)."""
        if reset:
            self.kv_ledger.reset_measurements()
        settings = self.kv_settings
        return {
            "settings": settings.as_dict() if settings else None,
            "ledger": self.kv_ledger.snapshot(),
            "free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
            "prefix_caching": bool(self.cache_config.enable_prefix_caching),
            "requests": self._hand_over_counters(requests or ()),
        }

    def _hand_over_counters(self, requests) -> dict[str, dict]:
        """Finished requests' counters, under the ids asked for: the engine's own ids, or the ids
        the caller gave vLLM (``LLM.generate`` numbers them), which vLLM suffixes with "-" and 8
        random characters to make the engine's (vllm/v1/engine/input_processor.py:371)."""
        asked = set(requests)
        owner = {key: key if key in asked else key[:-9] for key in self.kv_request_counters
                 if key in asked or (key[-9:-8] == "-" and key[:-9] in asked)}
        return {owner[key]: self.kv_request_counters.pop(key).as_dict() for key in owner}

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if request.request_id not in self.kv_request_settings:
            return num_new_tokens
        # vLLM calls this after its chunked-prefill decision, for running and waiting requests alike
        # (vllm/v1/core/sched/scheduler.py:570, called at :751 and :1213), so a shorter chunk here is
        # scheduled as a partial prefill and the rest follows in the next step.
        point = self.eviction_point(request)
        if num_computed_tokens < point:
            # A chunk never runs past the eviction point: prefill eviction happens exactly at the
            # prompt's end, or at the context's, before any question token is computed.
            return min(num_new_tokens, point - num_computed_tokens)
        if num_computed_tokens < request.num_prompt_tokens:
            return num_new_tokens  # the question, prefilled on top of the compressed context
        # Past the prompt (a preempted request recomputing its outputs): one token per step, so
        # it meets the same decode evictions at the same lengths as it did the first time.
        return min(num_new_tokens, 1)

    def schedule(self, *args, **kwargs):
        if self.kv_contexts is not None:
            self.kv_contexts.release_idle()
        output = super().schedule(*args, **kwargs)
        if self.kv_contexts is not None:
            self.kv_sharing.settle()
            if not output.total_num_scheduled_tokens and not self.running and self.waiting and \
                    self.kv_contexts.holders:
                # Nothing runs and nothing could be admitted: the chain entries held for preempted turns
                # may be what fills the pool. They are let go (free, found again until reclaimed; a turn
                # whose entry is reclaimed compresses the pristine history again), so the engine goes on.
                self.kv_contexts.holders.clear()
                self.kv_contexts.stats.chain_holds_dropped += 1
                self.kv_contexts.release_idle()
        ledger = self.kv_ledger
        scheduled = output.num_scheduled_tokens
        settings = {rid: self.kv_request_settings[rid] for rid in scheduled if rid in self.kv_request_settings}
        planned, self.kv_planned_targets = self.kv_planned_targets, {}
        # A step that schedules nothing never reaches the worker's input preparation
        # (gpu_model_runner.py:3989-4003 returns first): its releases wait for the next one.
        released = tuple(sorted(self.kv_released)) if output.total_num_scheduled_tokens else ()
        if released:
            self.kv_released = set()
        self.kv_step += 1
        patches.set_on(output, PLAN_ATTRIBUTE, EvictionPlan(
            default=self.kv_settings,
            settings=settings,
            evicted_tokens={rid: tuple(ledger.evicted[rid]) for rid in scheduled if rid in ledger.evicted},
            copy_targets={key: tuple(zip(positions, (b.block_id for b in blocks)))
                          for key, (positions, blocks) in planned.items()},
            released=released,
            step=self.kv_step,
            cache_salts={rid: self.requests[rid].cache_salt for rid in settings if self.requests[rid].cache_salt},
            prefix_cache_resets=self.kv_prefix_cache_resets,
        ))
        if output.total_num_scheduled_tokens:
            used = ledger.pool_blocks - self.kv_cache_manager.block_pool.get_num_free_blocks()
            ledger.steps += 1
            ledger.used_blocks_sum += used
            ledger.used_blocks_peak = max(ledger.used_blocks_peak, used)
            ledger.running_peak = max(ledger.running_peak, len(self.running))
            # every KV cache group's blocks (several with engine.layer_groups, harness.engine.layer_groups)
            groups = [manager.req_to_blocks for manager in self.kv_cache_manager.coordinator.single_type_managers]
            for request in self.running:
                if request.num_computed_tokens > request.num_prompt_tokens:  # generating, not prefilling
                    # (a sliding-window group's list holds the null block where vLLM freed the blocks
                    # that left the window: single_type_kv_cache_manager.py:651-670; not counted)
                    blocks = [sum(not block.is_null for block in held.get(request.request_id, ())) for held in groups]
                    ledger.decode_blocks_peak = max(ledger.decode_blocks_peak, sum(blocks))
                    if ledger.groups > 1 and request.request_id in self.kv_request_settings:
                        peaks = ledger.evicting_group_blocks_peak or [0] * ledger.groups
                        ledger.evicting_group_blocks_peak = [max(a, b) for a, b in zip(peaks, blocks)]
        if self.kv_contexts is not None and self.kv_contexts.of_block:
            self._check_writes(scheduled)
        # after the step's blocks were counted: the step uses the blocks its evictions leave
        self._expect_evictions(settings, scheduled, planned)
        if self.kv_sharing is not None and self.kv_sharing.continuing:
            self.kv_sharing.release_continued()  # a turn past its boundary eviction holds the history once
        return output

    def _check_writes(self, scheduled: dict[str, int]) -> None:
        """No step writes a block a shared compressed context holds (the blocks of its tokens'
        physical positions, before this step's eviction)."""
        managers = self.kv_cache_manager.coordinator.single_type_managers
        for request_id, count in scheduled.items():
            after = self.requests[request_id].num_computed_tokens
            for group, manager in enumerate(managers):
                evicted = self.evicted(request_id, group)
                first, last = (after - count - evicted) // self.kv_block_size, (after - 1 - evicted) // self.kv_block_size
                self.kv_contexts.check_writes(request_id, group, manager.req_to_blocks.get(request_id, ()), first, last,
                                              self.kv_block_size)

    def _expect_evictions(self, settings: dict[str, EvictionSettings], scheduled: dict[str, int], planned) -> None:
        """Count the evictions this plan schedules as done (the plan itself carries the counts
        from before them: the worker evicts after the step's model pass), and give back at once
        the blocks a compaction leaves: the worker reads them in this step, which runs before
        any later step can write them (one worker, one stream, steps in order). Each KV cache
        group evicts by its own budget and count."""
        for request_id, request_settings in settings.items():
            request = self.requests[request_id]
            after = request.num_computed_tokens  # vLLM advanced it by this step's tokens (_update_after_schedule)
            if request_settings.measuring:
                if after - scheduled[request_id] < self.eviction_point(request) <= after:
                    for group in range(self.kv_groups):  # measured and evicted by the worker in this step
                        self.kv_expected[(request_id, group)] = Undecided(self.kv_step, after - self.evicted(request_id, group))
                continue
            for group, policy in enumerate(self.group_policies(request_settings)):
                evicted = self.evicted(request_id, group)
                phase = phase_due(policy, self.eviction_point(request), after - scheduled[request_id], after, evicted)
                if phase is None:
                    continue
                key = (request_id, group)
                if key in self.kv_expected:
                    raise RuntimeError(f"request {request_id} is due to evict before its last eviction was reported")
                positions, copies = planned.get(key, ((), []))
                self._count(request_id, group,
                            expected_eviction(policy, phase, after - evicted, tuple(positions), self.kv_step), copies)

    def _count(self, request_id: str, group: int, expected: Expected, copies) -> None:
        """An eviction whose outcome is known (planned, or measured and reported): awaited in its
        report, counted as evicted now, and a compaction's released blocks given back now. One
        that changes nothing is neither: the worker reports nothing for it."""
        if expected.kept == tuple(range(expected.source_blocks)) and expected.evicted_tokens == 0:
            return
        self.kv_expected[(request_id, group)] = expected
        self.kv_ledger.evicted.setdefault(request_id, [0] * self.kv_groups)[group] += expected.evicted_tokens
        if expected.kept is not None:
            self._reshape(request_id, group, expected.source_blocks, list(copies), expected.kept)

    def _reshape(self, request_id: str, group: int, source_blocks: int, copies: list, kept: tuple[int, ...]) -> None:
        """The request's block list in ``group`` becomes its kept positions among its first
        ``source_blocks`` blocks and then ``copies`` (as the worker reshapes its own), followed by
        any blocks allocated since; the others go back to the pool."""
        blocks = self.kv_cache_manager.coordinator.single_type_managers[group].req_to_blocks[request_id]
        held, later = blocks[:source_blocks] + copies, blocks[source_blocks:]
        keep = set(kept)
        victims = [block for position, block in enumerate(held) if position not in keep]
        blocks[:] = [held[position] for position in kept] + later
        self.kv_cache_manager.block_pool.free_blocks(victims)

    def update_from_output(self, scheduler_output, model_runner_output):
        plan = scheduler_output.__dict__.get(PLAN_ATTRIBUTE)
        if plan is not None and plan.settings and model_runner_output.req_ids:
            report = required(
                model_runner_output, REPORT_ATTRIBUTE, "worker",
                "its model runner is not patched (the kv_eviction vLLM plugin did not load in the worker "
                "process; check VLLM_PLUGINS and that the harness is installed in this environment)",
            )
            self.kv_ledger.add_step(report)
            failed = self._end_failed(report, plan.step)
            for request_id, budgets in report.budgets.items():
                self._fix_budgets(request_id, budgets, plan.step)
            for (request_id, group), eviction in report.evictions.items():
                self._settle(request_id, group, eviction, plan.step)
            if self.kv_sharing is not None and self.kv_sharing.compressing:
                self.kv_sharing.publish_compressed()
            for (request_id, _), expected in list(self.kv_expected.items()):
                if expected.step == plan.step and self._live(request_id):
                    what = "measure the layer budgets of" if isinstance(expected, Undecided) else "evict"
                    raise EvictionNotActiveError(
                        f"the worker did not {what} request {request_id}, whose eviction step {plan.step} scheduled")
            return self._with_errors(super().update_from_output(scheduler_output, model_runner_output), failed)
        return self._with_errors(super().update_from_output(scheduler_output, model_runner_output), [])

    def _with_errors(self, outputs: dict, failed: list) -> dict:
        """vLLM's outputs of a step, plus the requests this scheduler ended with an error since the
        last: those whose policy failed in the step, and those refused on arrival (``add_request``)."""
        ended, self.kv_refused = [*self.kv_refused, *failed], []
        for request, message in ended:
            # as vLLM reports the requests it ends with an error itself (vllm/v1/core/sched/scheduler.py:2313-2326);
            # the frontend turns FinishReason.ERROR into HTTP 500 (entrypoints/generate/base/serving.py:200-207)
            # and an offline run reads the message from the output's stop_reason
            outputs.setdefault(request.client_index, EngineCoreOutputs(outputs=[])).outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                stop_reason=message, events=request.take_events(), trace_headers=request.trace_headers))
        return outputs

    def _end_failed(self, report, step: int) -> list:
        """The requests whose policy failed in ``step`` end with an error (``FINISHED_ERROR``): their
        blocks go back to the pool now, and their counters keep the message; the engine goes on."""
        ended = []
        for request_id, failure in report.failures.items():
            if not self._live(request_id):
                continue
            for group in range(self.kv_groups):
                expected = self.kv_expected.get((request_id, group))
                if expected is not None and expected.step == step and (request_id, group) not in report.evictions:
                    del self.kv_expected[(request_id, group)]  # never carried out: no report will settle it
            if request_id in self.kv_request_counters:
                self.kv_request_counters[request_id].failure = failure
            ended.extend((request, failure) for request in self.finish_requests(request_id, RequestStatus.FINISHED_ERROR))
        return ended

    def _fix_budgets(self, request_id: str, budgets: tuple[int, ...], step: int) -> None:
        """A measured schedule's group budgets (attention, kvzip), measured by the worker in ``step``: the request's
        settings from now on, and that step's prefill eviction counted in each group by them (the
        evictions the report carries are then settled against it, as any)."""
        settings = self.kv_request_settings.get(request_id)
        if settings is None or not settings.measuring:
            return  # finished since, or measured before and replayed: the first measurement stands
        settings = self.kv_request_settings[request_id] = replace(settings, group_budgets=tuple(budgets))
        self._counters(request_id, settings).group_budgets = list(budgets)
        point = self.eviction_point(self.requests[request_id])
        for group, policy in enumerate(self.group_policies(settings)):
            key = (request_id, group)
            undecided = self.kv_expected.get(key)
            if not isinstance(undecided, Undecided) or undecided.step != step:
                continue
            del self.kv_expected[key]
            if policy.needs_prefill_eviction(point):
                self._count(request_id, group, expected_eviction(policy, "prefill", undecided.tokens, (), step), [])

    def _live(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return request is not None and not request.is_finished()

    def _free_request_blocks(self, request):
        # Every way a request lets go of its blocks (finish, abort, preemption) passes here
        # (vllm/v1/core/sched/scheduler.py:2766, from _free_blocks and _preempt_request): its
        # evicted count goes with them, and its settings once it is finished.
        request_id = request.request_id
        ledger = self.kv_ledger
        if self.kv_contexts is not None and request.is_finished():
            self.kv_sharing.publish_chain(request)
            self.kv_contexts.let_go(request_id)
        elif self.kv_contexts is not None:
            # preempted (vllm/v1/core/sched/scheduler.py:1589, before it resets the computed tokens at :1593):
            # a turn past its boundary eviction keeps its own kept cache for its replay
            self.kv_sharing.keep_preempted(request)
        if any(ledger.evicted.pop(request_id, ())) and not request.is_finished():
            ledger.totals.preempted_after_eviction += 1
            if request_id in self.kv_request_counters:
                self.kv_request_counters[request_id].preempted_after_eviction += 1
        for group in range(self.kv_groups):
            expected = self.kv_expected.pop((request_id, group), None)
            if expected is not None:  # its blocks go whole: the late report of that eviction changes nothing
                self.kv_abandoned.add((request_id, group, expected.step))
            planned = self.kv_planned_targets.pop((request_id, group), None)  # preempted by the same schedule()
            if planned is not None:
                self.kv_cache_manager.block_pool.free_blocks(planned[1])
        if request_id in self.kv_request_settings:
            self.kv_released.add(request_id)
            if request.is_finished():
                del self.kv_request_settings[request_id]
                self.kv_uncached.discard(request_id)
        if self.kv_sharing is not None:
            self.kv_sharing.forget(request, request.is_finished())
        super()._free_request_blocks(request)
        if self.kv_contexts is not None:
            self.kv_contexts.release_idle()  # an entry no request holds now counts as free

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        # Compressed contexts go with the prefix cache (weights may have changed): the cache lets go
        # of them first, so that vLLM's reset finds every block free (block_pool.py:837-844).
        if self.kv_contexts is not None:
            self.kv_contexts.clear()
        # and so do the workers' kept reconstruction scores, at their next plan (vLLM tells only the
        # scheduler of a reset: vllm/v1/engine/core.py:871-876)
        self.kv_prefix_cache_resets += 1
        return super().reset_prefix_cache(*args, **kwargs)

    def _settle(self, request_id: str, group: int, eviction, step: int) -> None:
        """A reported eviction (of one KV cache group): checked against what its plan expected; a
        block policy's victim goes back to the pool now (the blocks allocated since stay after the
        kept ones)."""
        if (request_id, group, step) in self.kv_abandoned:  # finished or preempted since: its blocks were freed whole
            self.kv_abandoned.discard((request_id, group, step))
            return
        expected = self.kv_expected.pop((request_id, group), None)
        if expected is None or expected.step != step:
            raise RuntimeError(f"request {request_id} evicted at step {step}, which scheduled no eviction for it")
        if not expected.matches(eviction):
            raise RuntimeError(f"request {request_id}: the worker evicted {eviction.evicted_tokens} tokens keeping "
                               f"blocks {eviction.kept_blocks} of {eviction.held_blocks}; the plan expected {expected}")
        released = eviction.held_blocks - len(eviction.kept_blocks)
        if expected.kept is None and self._live(request_id):
            self._reshape(request_id, group, expected.source_blocks, [], eviction.kept_blocks)
        ledger = self.kv_ledger
        for counters in (ledger.totals, self._counters(request_id, self.kv_request_settings[request_id])):
            counters.record(eviction, released_blocks=released, copy_target_blocks=expected.copies)


class AsyncEvictionScheduler(EvictionScheduler, AsyncScheduler):
    """``EvictionScheduler`` on vLLM's asynchronous scheduler (``vllm/v1/core/sched/async_scheduler.py``),
    where step N+1 is planned before step N's output, and so its eviction report, is back: the
    plans already count scheduled evictions and give back what compaction leaves (``Expected``),
    and a block policy's victim goes back when the late report names it."""

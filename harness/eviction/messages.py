"""The two typed messages scheduler and worker exchange every step while eviction is on.

vLLM has no channel for eviction, so each message rides as one attribute on the object vLLM
already passes (``SchedulerOutput`` one way, ``ModelRunnerOutput`` the other; both are plain
objects that survive the multiprocess executor's pickling). Each side *requires* the other's
message when eviction is configured: a worker whose scheduler is stock vLLM, or a scheduler whose
worker was never patched, stops at its first step with the reason instead of running stock vLLM
under an eviction label. Nothing here imports vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.eviction.evictor import Eviction
from harness.eviction.settings import EvictionSettings

PLAN_ATTRIBUTE = "kv_eviction_plan"
REPORT_ATTRIBUTE = "kv_eviction_report"


class EvictionNotActiveError(RuntimeError):
    """Eviction was asked for but one side of the engine is not running it."""


@dataclass(frozen=True)
class EvictionPlan:
    """Scheduler to worker, every step.

    ``default``: the engine-wide settings (None: no eviction unless a request asks).
    ``settings``: each scheduled request that evicts, with its own settings.
    ``evicted_tokens``: each scheduled request's evicted-token counts (logical length minus
    physical length, which turns logical positions into physical slots), one per KV cache group
    (several with ``engine.layer_groups``, each group its own budget and physical length).
    ``copy_targets``: per (request, group) that evicts this step with prefix caching on: ``(position, block
    id)`` pairs, a position in the request's block list whose block is registered in the prefix
    cache (or shared) and the fresh block allocated this step that compaction writes instead, so
    it writes only blocks the request owns alone.
    ``released``: requests whose blocks were freed since the last plan (finished, aborted or
    preempted: the worker drops their cached scores).
    ``step``: the scheduler's count of plans; its report is matched to it (under asynchronous
    scheduling a report comes back after the next plan was made).
    ``cache_salts``: each scheduled request that evicts and has a cache salt, with it (the worker's
    request state has none; its kept reconstruction scores are keyed by it, as vLLM's prefix cache is).
    ``prefix_cache_resets``: how many times the scheduler's prefix cache was reset (weights may have
    changed): a worker drops its kept reconstruction scores when the count moves.
    """

    default: EvictionSettings | None
    settings: dict[str, EvictionSettings] = field(default_factory=dict)
    evicted_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    copy_targets: dict[tuple[str, int], tuple[tuple[int, int], ...]] = field(default_factory=dict)
    released: tuple[str, ...] = ()
    step: int = 0
    cache_salts: dict[str, str] = field(default_factory=dict)
    prefix_cache_resets: int = 0


@dataclass
class EvictionReport:
    """Worker to scheduler: the evictions this step carried out ((request id, KV cache group) -> how
    that group's block list changed), how long the model and the evictions took (the model's time includes copying the
    query window, ``capture_s`` of it), and the bytes of per-request policy state the worker holds.
    The scheduler counts what each eviction did (``harness.eviction.counters``) and adds the step's
    time to its ledger (``harness.engine.scheduler.Ledger.add_step``). ``budgets``: the group
    budgets the attention schedule measured this step, per request (the step's evictions already
    follow them). ``failures``: requests whose policy failed this step (``evictor.PolicyFailure``),
    with its message: nothing of theirs was evicted, and the scheduler ends them with an error."""

    evictions: dict[tuple[str, int], Eviction] = field(default_factory=dict)
    model_s: float = 0.0
    evict_s: float = 0.0
    capture_s: float = 0.0
    # a reconstructing policy's (KVzip's) passes this step: their seconds (inside evict_s) and tokens,
    # and the contexts whose scores the worker had from an earlier request (no pass ran)
    reconstruct_s: float = 0.0
    reconstruct_tokens: int = 0
    reconstruct_reused: int = 0
    state_bytes: int = 0
    budgets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def required(message_holder, attribute: str, sender: str, remedy: str):
    """The message ``attribute`` of ``message_holder``; its absence stops the engine."""
    message = message_holder.__dict__.get(attribute)
    if message is None:
        raise EvictionNotActiveError(
            f"KV eviction is asked for but the {sender} sent no eviction message this step: {remedy}"
        )
    return message

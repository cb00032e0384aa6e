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

from harness.engine.evictor import Eviction

PLAN_ATTRIBUTE = "kv_eviction_plan"
REPORT_ATTRIBUTE = "kv_eviction_report"


class EvictionNotActiveError(RuntimeError):
    """Eviction was asked for but one side of the engine is not running it."""


@dataclass(frozen=True)
class EvictionPlan:
    """Scheduler to worker: who evicts what, each scheduled request's evicted-token count (logical
    length minus physical length, which turns logical positions into physical slots), and the
    requests whose blocks were freed since the last plan (finished, aborted or preempted: the
    worker drops their cached scores)."""

    policy: str
    budget: int
    evicted_tokens: dict[str, int] = field(default_factory=dict)
    released: tuple[str, ...] = ()


@dataclass
class EvictionReport:
    """Worker to scheduler: the evictions this step carried out (request id -> what was dropped)
    and how long the model and the evictions took."""

    policy: str
    budget: int
    evictions: dict[str, Eviction] = field(default_factory=dict)
    model_s: float = 0.0
    evict_s: float = 0.0


def attach(message_holder, attribute: str, message) -> None:
    setattr(message_holder, attribute, message)


def required(message_holder, attribute: str, expected: tuple[str, int], sender: str, remedy: str):
    """The message ``attribute`` of ``message_holder``, checked to carry the expected settings."""
    message = message_holder.__dict__.get(attribute)
    if message is None:
        raise EvictionNotActiveError(
            f"KV eviction {expected[0]} budget={expected[1]} is configured but the {sender} sent no "
            f"eviction message this step: {remedy}"
        )
    if (message.policy, message.budget) != expected:
        raise EvictionNotActiveError(
            f"the {sender} runs eviction {message.policy} budget={message.budget} but this side was "
            f"configured with {expected[0]} budget={expected[1]}"
        )
    return message

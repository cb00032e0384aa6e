"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

vLLM calls ``register()`` in the engine-core process and in every worker before the worker class
is resolved. It refuses any vLLM but the pinned version (the patches depend on internals vLLM
itself calls "not public"), wraps the model runner's input preparation (``worker_patch``: vLLM
has no hook there), and gives the engine core one utility method, ``kv_eviction_state``, through
which a client reads the scheduler's settings and ledger whether the core runs in-process or in
its own process (``EngineCore._handle_client_request`` looks utilities up by name,
``vllm/v1/engine/core.py:1694``). The scheduler itself comes through vLLM's ``scheduler_cls``
hook (``harness.engine.scheduler``). Everything is inert for an engine without eviction settings.
"""
from __future__ import annotations

from harness.engine.llm import check_vllm_version


def kv_eviction_state(core, reset: bool = False) -> dict | None:
    """Engine-core utility: the eviction scheduler's state, or None under vLLM's own scheduler."""
    state = getattr(core.scheduler, "kv_eviction_state", None)
    return state(reset) if state is not None else None


def register() -> None:
    check_vllm_version()
    from vllm.v1.engine.core import EngineCore

    from harness.engine import worker_patch

    worker_patch.install()
    if not hasattr(EngineCore, "kv_eviction_state"):
        EngineCore.kv_eviction_state = kv_eviction_state

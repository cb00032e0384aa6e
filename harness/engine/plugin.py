"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

vLLM calls ``register()`` in the engine-core process and in every worker before the worker class
is resolved, so the patches apply wherever the scheduler and the model runner live (in-process or
in their own processes). It refuses any vLLM but the pinned version: the patches depend on
internals vLLM itself calls "not public". The patches are inert for an engine without eviction
settings (``additional_config={"kv_eviction": ...}``): vLLM then decides exactly as it would alone.
"""
from __future__ import annotations

from harness.engine.llm import check_vllm_version


def register() -> None:
    check_vllm_version()
    from harness.engine import scheduler_patch, worker_patch

    scheduler_patch.install()
    worker_patch.install()

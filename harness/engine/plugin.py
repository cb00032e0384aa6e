"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

vLLM calls ``register()`` in the engine-core process and in every worker before the worker class
is resolved. It refuses any vLLM but the pinned version: the eviction patch depends on internals
that vLLM itself calls "not public".
"""
from __future__ import annotations

from harness.engine.llm import check_vllm_version


def register() -> None:
    check_vllm_version()

"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

vLLM calls ``register()`` in the frontend (``vllm/engine/arg_utils.py:906``), in the engine-core
process and in every worker before the worker class is resolved. It refuses any vLLM but the
pinned version (the patches depend on internals vLLM itself calls "not public") and installs the
patches on vLLM's classes. Every patch, the ones on single objects too (made through that module's
helpers where the objects are), is listed in ``harness.engine.patches`` (what, how, why). The
scheduler itself comes through vLLM's ``scheduler_cls`` hook (``harness.engine.scheduler``).
Everything is inert for requests that do not evict.
"""
from __future__ import annotations

from harness.engine.llm import check_vllm_version


def register() -> None:
    check_vllm_version()
    from harness.engine import patches

    patches.install()

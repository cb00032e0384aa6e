"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

vLLM calls ``register()`` in the frontend (``vllm/engine/arg_utils.py:906``), in the engine-core
process and in every worker before the worker class is resolved. It refuses any vLLM but the
pinned version (the patches depend on internals vLLM itself calls "not public"), and:

* wraps the model runner's input preparation (``worker_patch``: vLLM has no hook there);
* tags the layers' KV cache specs into an engine's ``layer_groups`` (``layer_groups``: G = 1 leaves
  them as vLLM makes them);
* gives the engine core one utility method, ``kv_eviction_state``, through which a client reads
  the scheduler's settings, ledger and per-request stats whether the core runs in-process or in
  its own process (``EngineCore._handle_client_request`` looks utilities up by name,
  ``vllm/v1/engine/core.py:1694``);
* checks each request's eviction settings where vLLM validates sampling parameters
  (``InputProcessor._validate_params``, ``vllm/v1/engine/input_processor.py:138``), so a bad one is
  refused at admission (HTTP 400 from ``vllm serve``) and the engine keeps serving the others.
  vLLM's per-request hook for custom arguments, a logits processor's ``validate_params``
  (``vllm/v1/sample/logits_processor/interface.py:62``), sees the sampling parameters but not the
  engine's block size, which a budget must be a multiple of.

The scheduler itself comes through vLLM's ``scheduler_cls`` hook (``harness.engine.scheduler``).
Everything is inert for requests that do not evict.
"""
from __future__ import annotations

from harness.engine.llm import check_vllm_version
from harness.engine.compatibility import check_compatible, layer_groups_of
from harness.eviction.settings import (CONFIG_KEY, build_policy, check_policy_runs, check_schedule_runs, group_policies,
                                       request_settings, settings_from)


def kv_eviction_state(core, reset: bool = False, requests: list[str] | None = None) -> dict | None:
    """Engine-core utility: the eviction scheduler's state, or None under vLLM's own scheduler."""
    state = getattr(core.scheduler, "kv_eviction_state", None)
    return state(reset, requests) if state is not None else None


def check_request(vllm_config, params, prompt_tokens: int | None = None) -> None:
    """Refuse, with the reason, a request whose eviction settings this engine cannot run; with the
    prompt's length, also settings that cannot apply to it (a context boundary beyond the prompt,
    or missing where the engine compresses contexts by default)."""
    extra = getattr(params, "extra_args", None)
    default = settings_from(vllm_config)
    if (not extra or CONFIG_KEY not in extra) and (default is None or prompt_tokens is None):
        return
    from vllm.exceptions import VLLMValidationError

    try:
        block_size = vllm_config.cache_config.block_size
        settings = request_settings(extra, default, block_size)
        if settings is not None:
            check_compatible(vllm_config)
            check_policy_runs(build_policy(settings, block_size), vllm_config.model_config.enforce_eager)
            check_schedule_runs(settings, vllm_config.model_config.enforce_eager,
                                bool(vllm_config.scheduler_config.async_scheduling))
            if prompt_tokens is not None:
                settings = settings.for_prompt(prompt_tokens, block_size)
            # the budget spread over the engine's layer groups: a schedule that cannot apply (any but
            # uniform on a one-group engine) is refused here, not by the scheduler's backstop
            groups = layer_groups_of(vllm_config)
            layers = vllm_config.model_config.hf_text_config.num_hidden_layers if groups > 1 else 1
            group_policies(settings, block_size, layers, groups)
    except ValueError as error:
        raise VLLMValidationError(str(error), parameter=CONFIG_KEY) from None


def install_request_check() -> None:
    """Every request passes ``InputProcessor.process_inputs`` (offline and ``vllm serve``, where a
    ``VLLMValidationError`` is an HTTP 400); its settings are checked there, with its prompt: the
    returned ``EngineCoreRequest`` carries the prompt's token ids (vllm/v1/engine/input_processor.py:373,
    ``_validate_params`` at :389 runs before the prompt is known)."""
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor, "_kv_eviction_checked", False):
        return
    InputProcessor._kv_eviction_checked = True
    original = InputProcessor.process_inputs

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        prompt = request.prompt_token_ids
        if request.sampling_params is not None and prompt is not None:
            check_request(self.vllm_config, request.sampling_params, len(prompt))
        return request

    InputProcessor.process_inputs = process_inputs


def register() -> None:
    check_vllm_version()
    from vllm.v1.engine.core import EngineCore

    from harness.engine import layer_groups, worker_patch

    worker_patch.install()
    layer_groups.install()
    install_request_check()
    if not hasattr(EngineCore, "kv_eviction_state"):
        EngineCore.kv_eviction_state = kv_eviction_state

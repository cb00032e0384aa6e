"""What the frontend and the engine core get from the harness (installed by ``harness.engine.patches``):

* the engine core's utility method ``kv_eviction_state``, through which a client reads the
  scheduler's settings, ledger and per-request stats whether the core runs in-process or in its
  own process (``EngineCore._handle_client_request`` looks utilities up by name,
  ``vllm/v1/engine/core.py:1694``);
* the check of each request's eviction settings in ``InputProcessor.process_inputs``, so a bad one
  is refused at admission (HTTP 400 from ``vllm serve``) and the engine keeps serving the others.
  vLLM's per-request hook for custom arguments, a logits processor's ``validate_params``
  (``vllm/v1/sample/logits_processor/interface.py:62``), sees the sampling parameters but not the
  engine's block size, which a budget must be a multiple of.
"""
from __future__ import annotations

import functools

from harness.engine.compatibility import check_compatible, layer_groups_of
from harness.eviction.settings import CONFIG_KEY, admit, request_settings, settings_from


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
            if prompt_tokens is not None:
                settings = settings.for_prompt(prompt_tokens, block_size)
            # the budget spread over the engine's layer groups: a schedule that cannot apply (any but
            # uniform on a one-group engine) is refused here, not by the scheduler's backstop
            groups = layer_groups_of(vllm_config)
            layers = vllm_config.model_config.hf_text_config.num_hidden_layers if groups > 1 else 1
            admit(settings, block_size, layers, groups, enforce_eager=vllm_config.model_config.enforce_eager,
                  async_scheduling=bool(vllm_config.scheduler_config.async_scheduling))
            if settings.share_context and not vllm_config.cache_config.enable_prefix_caching:
                # (the scheduler's backstop says the same: harness.engine.scheduler.unshared_reason)
                raise ValueError("share_context=true, but compressed contexts are shared through vLLM's prefix-cache "
                                 "hits, which this engine does not take: start it with prefix caching on")
    except ValueError as error:
        raise VLLMValidationError(str(error), parameter=CONFIG_KEY) from None


def wrap_process_inputs(original):
    """Every request passes ``InputProcessor.process_inputs`` (offline and ``vllm serve``, where a
    ``VLLMValidationError`` is an HTTP 400); its settings are checked there, with its prompt: the
    returned ``EngineCoreRequest`` carries the prompt's token ids (vllm/v1/engine/input_processor.py:373,
    ``_validate_params`` at :389 runs before the prompt is known)."""

    @functools.wraps(original)
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        prompt = request.prompt_token_ids
        if request.sampling_params is not None and prompt is not None:
            check_request(self.vllm_config, request.sampling_params, len(prompt))
        return request

    return process_inputs

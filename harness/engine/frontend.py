"""What the frontend and the engine core get from the harness (installed by ``harness.engine.patches``):

* the engine core's utility method ``kv_eviction_state``, through which a client reads the
  scheduler's settings, ledger and per-request stats whether the core runs in-process or in its
  own process (``EngineCore._handle_client_request`` looks utilities up by name,
  ``vllm/v1/engine/core.py:1694``);
* the same state on the served app, ``GET /kv_eviction/state[?reset=1]`` (``STATE_ROUTE``): the
  scheduler's settings and ledger as JSON (404 under vLLM's own scheduler), read through that
  utility from the server's process; ``reset=1`` starts the ledger's measurements afresh first;
* the check of each request's eviction settings in ``InputProcessor.process_inputs``, so a bad one
  is refused at admission (HTTP 400 from ``vllm serve``) and the engine keeps serving the others.
  vLLM's per-request hook for custom arguments, a logits processor's ``validate_params``
  (``vllm/v1/sample/logits_processor/interface.py:62``), sees the sampling parameters but not the
  engine's block size, which a budget must be a multiple of;
* there too, a request whose policy reconstructs its context (KVzip) and that brings no
  ``reconstruction`` ids gets them from the server's tokenizer, as ``run.py``'s prompt builder makes
  them for the same prompt (``served_reconstruction``): the engine core and workers hold no tokenizer;
* the policy's message on the HTTP error of a request whose policy failed while it ran: the
  scheduler ends it with ``FinishReason.ERROR`` and the message as its stop reason
  (``harness.engine.scheduler.EvictionScheduler._end_failed``), but vLLM's server answers every
  such request with a fixed "Internal server error" (``GenerateBaseServing._raise_if_error``,
  vllm/entrypoints/generate/base/serving.py:200-207, which is given the finish reason and the
  request's id, not its output). The frontend's ``RequestState.make_request_output``
  (vllm/v1/engine/output_processor.py:307) sees the stop reason: it notes the message under the
  request's id, and ``_raise_if_error`` raises it (still HTTP 500: the request was valid, its
  policy failed).
"""
# (no ``from __future__ import annotations``: FastAPI reads the state route's parameter annotations, which a
# string would leave unresolved, the route's Request a query parameter)
import functools
from collections import OrderedDict
from dataclasses import replace

from harness.engine import patches
from harness.engine.compatibility import REFUSED, check_compatible, layer_groups_of, prefix_cache_refusal
from harness.eviction.settings import CONFIG_KEY, admit, request_settings, settings_from
from harness.engine.layer_groups import sliding_window_layers
from harness.eviction.admission import hybrid_refusal


def kv_eviction_state(core, reset: bool = False, requests: list[str] | None = None) -> dict | None:
    """Engine-core utility: the eviction scheduler's state, or None under vLLM's own scheduler."""
    state = getattr(core.scheduler, "kv_eviction_state", None)
    return state(reset, requests) if state is not None else None


STATE_ROUTE = "/kv_eviction/state"


def wrap_create_engine_config(original):
    """``EngineArgs.create_engine_config`` (vllm/engine/arg_utils.py:2205), then, where the engine has
    an eviction default, what eviction cannot coexist with (``check_compatible``), refused there: in
    ``vllm serve``'s API server before any engine process starts or a model loads, where the
    worker would refuse it only once the model and its KV cache were set up
    (``harness.engine.worker_patch``). The plugin's patches are installed by then: EngineArgs loads
    vLLM's general plugins when it is made (arg_utils.py:903-906)."""
    @functools.wraps(original)
    def create_engine_config(self, usage_context=None, headless=False):
        vllm_config = original(self, usage_context, headless)
        if settings_from(vllm_config) is not None:
            check_compatible(vllm_config)
        return vllm_config
    return create_engine_config


def wrap_register_api_routers(original):
    """``vllm serve`` builds its app in ``build_app`` (vllm/entrypoints/launchers/app.py:19-56), which
    calls ``register_api_routers`` (:45, looked up in that module when it runs) to add vLLM's own
    routers; the state's route is added after them. (vLLM's endpoint plugins, :51, would need an entry
    point that loads only where ``VLLM_PLUGINS`` names it: vllm/plugins/__init__.py:93-131.)"""

    @functools.wraps(original)
    def register_api_routers(args, app, *rest, **kwargs):
        original(args, app, *rest, **kwargs)
        app.include_router(state_router())

    return register_api_routers


def state_router():
    """The route reading the scheduler's state: the served app's engine client (``app.state.engine_client``,
    set by ``init_app_state``, vllm/entrypoints/launchers/api_server/app_state.py:63) calls the engine
    core's ``kv_eviction_state`` utility (``AsyncMPClient.call_utility_async``,
    vllm/v1/engine/core_client.py:1259; with data parallelism, the first engine's:
    :1699-1701). Per-request counters are not read here (``requests`` is None)."""
    from fastapi import APIRouter, Query, Request
    from fastapi.responses import JSONResponse

    router = APIRouter()

    @router.get(STATE_ROUTE)
    async def kv_eviction_state_route(raw_request: Request, reset: bool = Query(default=False)):
        client = getattr(getattr(raw_request.app.state, "engine_client", None), "engine_core", None)
        state = None if client is None else await client.call_utility_async("kv_eviction_state", reset, None)
        if state is None:
            return JSONResponse(status_code=404, content={"error": "this server runs no eviction scheduler "
                                                                   "(--scheduler-cls harness.engine.scheduler.EvictionScheduler)"})
        return JSONResponse(content=state)

    return router


def check_request(vllm_config, params, prompt_tokens: int | None = None, reconstruct=None) -> None:
    """Refuse, with the reason, a request whose eviction settings this engine cannot run; with the
    prompt's length, also settings that cannot apply to it (a context boundary beyond the prompt,
    or missing where the engine compresses contexts by default). ``reconstruct``: where a
    reconstructing policy's request brings no ids of its own, what makes them for its prompt
    (given the policy's name: ``served_reconstruction``; a ``ValueError`` says why it cannot); they
    become the request's own settings, which the scheduler reads."""
    extra = getattr(params, "extra_args", None)
    default = settings_from(vllm_config)
    if (not extra or CONFIG_KEY not in extra) and (default is None or prompt_tokens is None):
        return
    from vllm.exceptions import VLLMValidationError

    try:
        block_size = vllm_config.cache_config.block_size
        settings = request_settings(extra, default, block_size)
        if settings is not None and settings.reconstructs and settings.reconstruction is None and reconstruct:
            settings = replace(settings, reconstruction=reconstruct(settings.policy))
            # written back as the request's own settings (the engine default's too, copied): the scheduler
            # reads them there (harness.engine.scheduler.EvictionScheduler.add_request)
            patches.set_on(params, "extra_args", {**(extra or {}), CONFIG_KEY: settings.as_dict()})
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
            # what a model with sliding-window layers cannot run yet (harness.engine.layer_groups)
            if sliding_window_layers(vllm_config.model_config):
                refusal = hybrid_refusal(settings)
                if refusal is not None:
                    raise ValueError(refusal)
            refusal = prefix_cache_refusal(settings, prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                                           connector=vllm_config.kv_transfer_config is not None,
                                           skips_prefix_cache=bool(getattr(params, "skip_reading_prefix_cache", False)))
            if refusal is not None:
                raise ValueError(refusal)
    except (ValueError, TypeError) as error:  # (a TypeError: an option of the wrong type for its policy)
        raise VLLMValidationError(str(error), parameter=CONFIG_KEY) from None


# The request ids vLLM's server gives a prompt its chat template wrote: "chatcmpl-"
# (vllm/entrypoints/openai/chat_completion/serving.py:314-316, batch_serving.py:132-134) and the
# Responses API's "resp_" (vllm/entrypoints/openai/responses/protocol.py:301). They reach
# ``process_inputs`` as its request_id (vllm/v1/engine/async_llm.py:474-476), before vLLM makes it
# unique (``assign_request_id``, :512). A prompt with no such id is a chat prompt where it begins
# with the template's header (``harness.tasks.prompts.ids_reconstruction``).
CHAT_REQUEST_IDS = ("chatcmpl-", "resp_")


def served_reconstruction(tokenizer, token_ids: list[int], request_id: str, policy: str) -> dict:
    """A served prompt's reconstruction ids, made by ``run.py``'s prompt builder's rule
    (``harness.tasks.prompts.ids_reconstruction``) with the server's tokenizer; ``ValueError``
    (HTTP 400) where it cannot make them."""
    from harness.tasks.prompts import ids_reconstruction

    ask = "give them as reconstruction: {prefix_tokens, first, later, suffix} (harness.eviction.settings.Reconstruction)"
    if tokenizer is None:
        raise ValueError(f"{policy} reconstructs the request's context with ids a tokenizer makes, and this server "
                         f"has none (--skip-tokenizer-init): {ask}")
    ids = ids_reconstruction(tokenizer, token_ids, chat=str(request_id).startswith(CHAT_REQUEST_IDS))
    if ids is None:
        raise ValueError(f"{policy} reconstructs the request's context after its chat header, and this chat prompt "
                         "does not begin with the header the chat template writes before one user message (a system "
                         f"message of its own, earlier turns, or a template that does not write the message verbatim): {ask}")
    return ids


def wrap_process_inputs(original):
    """Every request passes ``InputProcessor.process_inputs`` (offline and ``vllm serve``, where a
    ``VLLMValidationError`` is an HTTP 400); its settings are checked there, with its prompt: the
    returned ``EngineCoreRequest`` carries the prompt's token ids (vllm/v1/engine/input_processor.py:538-540,
    ``_validate_params`` at :389 runs before the prompt is known), and the input processor holds the
    server's tokenizer (``InputProcessor.tokenizer``, :86-88), with which a reconstructing policy's
    ids are made where the request brings none. ``request.sampling_params`` is the request's own
    copy (:449), so its settings can be completed there."""

    @functools.wraps(original)
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        prompt = request.prompt_token_ids
        if request.sampling_params is not None and prompt is not None:
            reconstruct = functools.partial(served_reconstruction, self.tokenizer, prompt, request.request_id)
            check_request(self.vllm_config, request.sampling_params, len(prompt), reconstruct)
        return request

    return process_inputs


# Policy failures and the scheduler's refusals noted by the frontend, by the request id its output carries (the id the server
# gave the request, with "-<prompt index>" for a completion's prompts), until the server answers
# them; offline runs read the message from the output itself and never take these, so only the
# latest FAILURES_KEPT are kept.
_FAILURES: OrderedDict[str, str] = OrderedDict()
FAILURES_KEPT = 1024
POLICY_FAILURE = "policy "  # how a policy failure's message starts (harness.eviction.evictor.PolicyFailure)


def wrap_make_request_output(original):
    """Note a policy failure's message under its request's id as its final output is made."""

    @functools.wraps(original)
    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs):
        from vllm.v1.engine import FinishReason

        if (finish_reason == FinishReason.ERROR and isinstance(stop_reason, str)
                and stop_reason.startswith((POLICY_FAILURE, REFUSED))):
            _FAILURES[self.external_req_id] = stop_reason
            while len(_FAILURES) > FAILURES_KEPT:
                _FAILURES.popitem(last=False)
        return original(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs)

    return make_request_output


def failure_of(request_id: str) -> str | None:
    """The policy failure noted for the server's request ``request_id`` (or one of its prompts),
    taken out of the notes."""
    for key in [key for key in _FAILURES if key == request_id or key.startswith(f"{request_id}-")]:
        return _FAILURES.pop(key)
    return None


def wrap_raise_if_error(original):
    """A request that ended with an error raises its policy's message when it has one, vLLM's own
    fixed error otherwise."""

    @functools.wraps(original)
    def _raise_if_error(self, finish_reason, request_id):
        if finish_reason == "error":
            message = failure_of(request_id)
            if message is not None:
                from vllm.exceptions import GenerationError

                raise GenerationError(message)
        return original(self, finish_reason, request_id)

    return _raise_if_error

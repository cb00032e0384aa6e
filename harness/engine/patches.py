"""Every place the harness changes vLLM 0.32.0, in one list, installed from here.

vLLM's own extension points carry what they can: the general plugin (``harness.engine.plugin``,
which calls ``install()`` in every vLLM process) and ``scheduler_cls``
(``harness.engine.scheduler.EvictionScheduler``). What they cannot reach is patched, and each patch
is a ``Patch`` below: the vLLM name it touches, how, the parameters that name has in vLLM 0.32.0,
and why. ``tests/unit/test_vllm_patches.py`` checks every name and its parameters against the
installed vLLM, so an upgrade that moves one fails there, by name, before any engine starts.

How a name is touched:

* ``wrapped``: the method is replaced, on vLLM's class, by one that calls vLLM's own (installed here;
  a module's function likewise, in the module that calls it);
* ``added``: a new attribute on vLLM's class (installed here; the name must not exist in vLLM);
* ``overridden``: a subclass of the harness redefines it (vLLM's hook installs the subclass: the
  scheduler through ``scheduler_cls``; the KV managers by swapping an instance's class);
* ``implemented``: a method of a vLLM extension-point class that vLLM calls on the harness's
  subclass (the logits processor, loaded by name);
* ``called``: not changed, but called by the harness where vLLM itself calls it (its parameters
  are a contract all the same);

and on one object only, through the helpers below (``set_on``, ``take_from``, ``replaced_on``,
``swap_class``), the only code outside this file that writes an attribute of a vLLM object
(``tests/unit/test_patch_guard.py`` scans the harness for any other write):

* ``replaced on an instance``: one object's method, set on that object (vLLM's own class keeps its);
* ``hooked on an instance``: a torch forward pre-hook on one module, which reads the method's
  arguments (nothing is set: the parameters are the contract);
* ``added on an instance``: a new attribute on one object, the harness's state riding on it (the
  name must not exist in vLLM);
* ``field set on an instance``: a field vLLM declares, written on one object;
* ``class swapped on an instance``: one object's class replaced by the harness subclass ``by``
  names (a direct subclass without state of its own: the object keeps vLLM's).
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
MANAGER = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"
ATTENTION = "vllm.model_executor.layers.attention.attention:Attention"
ATTENTION_PARAMETERS = ("self", "query", "key", "value", "output_shape", "output_dtype")
SAMPLING_PARAMS = "vllm.sampling_params:SamplingParams"
LOGITS_PROCESSOR = "vllm.v1.sample.logits_processor:LogitsProcessor"


@dataclass(frozen=True)
class Patch:
    owner: str                      # "module:Class" in vLLM ("module:" for a module's own function)
    name: str                       # the attribute touched
    how: str                        # one of HOW
    parameters: tuple[str, ...]     # vLLM 0.32.0's own (empty for an added name)
    why: str
    by: str                         # the harness code that does it
    make: Callable | None = None    # wrapped: vLLM's method -> the wrapper; added: the attribute

    def __post_init__(self):
        if self.how not in HOW:
            raise ValueError(f"{self.target}: unknown kind {self.how!r} (one of {HOW})")

    @property
    def target(self) -> str:
        return f"{self.owner}.{self.name}"

    def owner_class(self):
        """The class, or the module where ``owner`` names no class."""
        module, qualname = self.owner.split(":")
        module = importlib.import_module(module)
        return getattr(module, qualname) if qualname else module


CLASS_KINDS = ("wrapped", "added", "overridden", "implemented", "called")
INSTANCE_KINDS = ("replaced on an instance", "hooked on an instance", "added on an instance",
                  "field set on an instance", "class swapped on an instance")
HOW = CLASS_KINDS + INSTANCE_KINDS


def _lazy(module: str, name: str) -> Callable:
    """A factory imported only when installing (the modules that make the patches import vLLM)."""
    return lambda original: getattr(importlib.import_module(module), name)(original)


PATCHES: tuple[Patch, ...] = (
    # The worker: vLLM has no hook around a runner's input preparation or after its sampling.
    Patch(RUNNER, "initialize_kv_cache", "wrapped", ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
          "attach the runner's eviction state (views of its KV cache, query capture) once the cache exists",
          "harness.engine.worker_patch.wrap_initialize_kv_cache",
          _lazy("harness.engine.worker_patch", "wrap_initialize_kv_cache")),
    Patch(RUNNER, "_prepare_inputs", "wrapped", ("self", "scheduler_output", "num_scheduled_tokens"),
          "make attention lengths and slots physical (logical minus evicted), plan the query rows to copy",
          "harness.engine.worker_patch.wrap_prepare_inputs", _lazy("harness.engine.worker_patch", "wrap_prepare_inputs")),
    Patch(RUNNER, "execute_model", "wrapped", ("self", "scheduler_output", "intermediate_tensors"),
          "remember the step for the eviction after sampling; drop the step's per-group lengths",
          "harness.engine.worker_patch.wrap_execute_model", _lazy("harness.engine.worker_patch", "wrap_execute_model")),
    Patch(RUNNER, "sample_tokens", "wrapped", ("self", "grammar_output"),
          "run the step's evictions once its K/V are written, and attach the report to the runner's output; "
          "sample a partial prefill's discarded token without its CPU generator, which vLLM's rewind "
          "(set_offset, gpu_model_runner.py:3495-3502) would crash on (worker_patch.hold_unrewindable_generators)",
          "harness.engine.worker_patch.wrap_sample_tokens", _lazy("harness.engine.worker_patch", "wrap_sample_tokens")),
    Patch(RUNNER, "get_kv_cache_spec", "wrapped", ("self",),
          "tag each layer's spec with its layer group, so vLLM forms engine.layer_groups KV cache groups",
          "harness.engine.layer_groups.wrap_get_kv_cache_spec",
          _lazy("harness.engine.layer_groups", "wrap_get_kv_cache_spec")),
    Patch("vllm.v1.worker.utils:AttentionGroup", "build_metadata", "wrapped",
          ("self", "common_attn_metadata", "ubatch_idx", "common_prefix_len", "kwargs"),
          "give a layer group whose evicted count differs from the others its own seq_lens",
          "harness.engine.worker_patch.wrap_build_metadata", _lazy("harness.engine.worker_patch", "wrap_build_metadata")),
    # The frontend: a logits processor's validate_params does not see the block size or the prompt.
    Patch("vllm.v1.engine.input_processor:InputProcessor", "process_inputs", "wrapped",
          ("self", "request_id", "prompt", "params", "supported_tasks", "arrival_time", "lora_request",
           "tokenization_kwargs", "trace_headers", "priority", "data_parallel_rank", "resumable", "session_id",
           "kv_hints"),
          "refuse a request whose eviction settings cannot run, with its prompt's length (HTTP 400); give a "
          "KVzip request without reconstruction ids those its prompt builder's rule makes from the tokenizer",
          "harness.engine.frontend.wrap_process_inputs", _lazy("harness.engine.frontend", "wrap_process_inputs")),
    # The server: a request ended by its policy's failure gets a fixed error text.
    Patch("vllm.v1.engine.output_processor:RequestState", "make_request_output", "wrapped",
          ("self", "new_token_ids", "pooling_output", "finish_reason", "stop_reason", "kv_transfer_params",
           "ec_transfer_params", "error"),
          "note a failed policy's message (the request's stop reason) under the request's id",
          "harness.engine.frontend.wrap_make_request_output", _lazy("harness.engine.frontend", "wrap_make_request_output")),
    Patch("vllm.entrypoints.generate.base.serving:GenerateBaseServing", "_raise_if_error", "wrapped",
          ("self", "finish_reason", "request_id"),
          "answer a request whose policy failed with the policy's message instead of a fixed text (HTTP 500)",
          "harness.engine.frontend.wrap_raise_if_error", _lazy("harness.engine.frontend", "wrap_raise_if_error")),
    # The engine's config: vLLM has no hook after it is made, before the engine processes start.
    Patch("vllm.engine.arg_utils:EngineArgs", "create_engine_config", "wrapped", ("self", "usage_context", "headless"),
          "refuse an eviction default the engine cannot run (its scheduler, KV cache dtype, parallelism) before "
          "any engine process starts or a model loads",
          "harness.engine.frontend.wrap_create_engine_config",
          _lazy("harness.engine.frontend", "wrap_create_engine_config")),
    # The served app: vLLM's build_app has no hook for a router that loads without VLLM_PLUGINS naming it.
    Patch("vllm.entrypoints.launchers.app:", "register_api_routers", "wrapped",
          ("args", "app", "supported_tasks", "model_config"),
          "add GET /kv_eviction/state (the scheduler's settings and ledger) after vLLM's own routes",
          "harness.engine.frontend.wrap_register_api_routers",
          _lazy("harness.engine.frontend", "wrap_register_api_routers")),
    # The engine core: utilities are looked up by name (vllm/v1/engine/core.py, call_utility).
    Patch("vllm.v1.engine.core:EngineCore", "kv_eviction_state", "added", (),
          "let a client read the scheduler's eviction ledger and per-request counters in any process layout",
          "harness.engine.frontend.kv_eviction_state",
          lambda _absent: importlib.import_module("harness.engine.frontend").kv_eviction_state),
    # The scheduler, through scheduler_cls: its constructor and public methods extended, private ones overridden.
    Patch(SCHEDULER, "__init__", "overridden",
          ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size",
           "mm_registry", "include_finished_set", "log_stats"),
          "vLLM's scheduler made, then the eviction ledger and settings, its KV managers' class swapped and its KV "
          "cache manager's get_computed_blocks replaced", "harness.engine.scheduler.EvictionScheduler"),
    Patch(SCHEDULER, "add_request", "overridden", ("self", "request"),
          "resolve and keep each request's eviction settings", "harness.engine.scheduler.EvictionScheduler"),
    Patch(SCHEDULER, "schedule", "overridden", ("self", "throttle_prefills"),
          "attach the step's eviction plan; count the blocks in use", "harness.engine.scheduler.EvictionScheduler"),
    Patch(SCHEDULER, "update_from_output", "overridden", ("self", "scheduler_output", "model_runner_output"),
          "settle the worker's eviction report, return released blocks, end requests whose policy failed",
          "harness.engine.scheduler.EvictionScheduler"),
    Patch(SCHEDULER, "finish_requests", "called", ("self", "request_ids", "finished_status"),
          "called (not redefined) to end a failed request with FINISHED_ERROR, as vLLM ends its own",
          "harness.engine.scheduler.EvictionScheduler._end_failed"),
    Patch(SCHEDULER, "_reserve_prefill_lookahead", "overridden", ("self", "request", "num_computed_tokens", "num_new_tokens"),
          "stop a prefill chunk exactly at the eviction point (private in vLLM)",
          "harness.engine.scheduler.EvictionScheduler"),
    Patch(SCHEDULER, "_free_request_blocks", "overridden", ("self", "request"),
          "forget a request's evicted counts and expected evictions with its blocks; let go of shared "
          "compressed contexts no request holds; publish a finished chain=true turn's kept cache for the next "
          "turn before its blocks go (private in vLLM)",
          "harness.engine.scheduler.EvictionScheduler"),
    Patch(SCHEDULER, "_handle_blocked_waiting_request", "overridden", ("self", "request"),
          "hold back a request whose context another request is compressing now (private in vLLM)",
          "harness.engine.scheduler.EvictionScheduler"),
    Patch(SCHEDULER, "reset_prefix_cache", "overridden", ("self", "reset_running_requests", "reset_connector"),
          "drop the shared compressed contexts with the prefix cache, and count the reset in the plan, so that the "
          "workers drop their kept reconstruction scores (vLLM tells only the scheduler: vllm/v1/engine/core.py:871-876)",
          "harness.engine.scheduler.EvictionScheduler"),
    # The scheduler's KV managers: each instance's class swapped to a subclass sized by physical length,
    # which reads the scheduler and its group from two attributes set on the instance.
    Patch(MANAGER, "get_num_blocks_to_allocate", "overridden",
          ("self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
           "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "prefill_end"),
          "size an evicted request by its physical length (instance class swapped in EvictionScheduler.__init__)",
          "harness.engine.scheduler.PhysicalLengthManager"),
    Patch(MANAGER, "allocate_new_blocks", "overridden", ("self", "request_id", "num_tokens", "num_tokens_main_model"),
          "allocate by physical length, and the copy targets compaction writes under prefix caching",
          "harness.engine.scheduler.PhysicalLengthManager"),
    Patch(MANAGER, "add_local_computed_blocks", "overridden",
          ("self", "request_id", "new_computed_blocks", "num_local_computed_tokens", "num_external_computed_tokens"),
          "decide a shared compressed context's partial-block copy by the tokens its blocks hold",
          "harness.engine.scheduler.PhysicalLengthManager"),
    Patch(MANAGER, "cache_blocks", "overridden", ("self", "request", "num_tokens", "retention_interval",
                                                   "replay_boundaries"),
          "register no block of a request once it evicted (its blocks no longer hold what their hashes say)",
          "harness.engine.scheduler.PhysicalLengthManager"),
    Patch(MANAGER, "__class__", "class swapped on an instance", (),
          "each of the scheduler's full-attention managers becomes a PhysicalLengthManager (its methods above), "
          "keeping vLLM's state; only this engine's managers, only when it can evict",
          "harness.engine.scheduler.PhysicalLengthManager"),
    Patch(MANAGER, "kv_scheduler", "added on an instance", (),
          "a swapped manager reads its request's evicted count and expected eviction from the scheduler",
          "harness.engine.scheduler.EvictionScheduler.__init__"),
    Patch(MANAGER, "kv_group", "added on an instance", (),
          "a swapped manager's KV cache group (several with engine.layer_groups, each its own count)",
          "harness.engine.scheduler.EvictionScheduler.__init__"),
    # The scheduler's KV cache manager: one method replaced on the scheduler's own instance.
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager", "get_computed_blocks", "replaced on an instance",
          ("self", "request"),
          "cap an evicting request's prefix-cache hits before its eviction point; hand a request a shared "
          "compressed context, or a chain=true turn its previous turn's compressed cache",
          "harness.engine.scheduler.EvictionScheduler._cap_replayed_cache_hits"),
    Patch("vllm.v1.core.block_pool:BlockPool", "unpin_blocks", "called", ("self", "blocks", "on_reuse"),
          "called to release an idle shared compressed context: free, readable until the pool reuses a block",
          "harness.engine.shared_contexts.ContextCache"),
    Patch("vllm.v1.core.block_pool:BlockPool", "touch", "called", ("self", "blocks"),
          "called to hold a shared compressed context's blocks while requests use them",
          "harness.engine.shared_contexts.ContextCache"),
    # The messages: each rides as one attribute on the object vLLM already passes (harness.eviction.messages).
    Patch("vllm.v1.core.sched.output:SchedulerOutput", "kv_eviction_plan", "added on an instance", (),
          "the scheduler's eviction plan for the step, read by every worker (pickled with the output's __dict__)",
          "harness.engine.scheduler.EvictionScheduler.schedule"),
    Patch("vllm.v1.outputs:ModelRunnerOutput", "kv_eviction_report", "added on an instance", (),
          "the worker's eviction report for the step, read by the scheduler", "harness.engine.worker_patch.wrap_sample_tokens"),
    # The worker's model runner and its attention.
    Patch(RUNNER, "_kv_eviction", "added on an instance", (),
          "the runner's eviction state (WorkerEviction), once its KV cache exists; dropped for a profiling cache",
          "harness.engine.worker_patch.attach_eviction_state"),
    Patch(RUNNER, "_kv_step", "added on an instance", (),
          "the step being run (its scheduler output and start time), from execute_model to sample_tokens",
          "harness.engine.worker_patch.wrap_execute_model"),
    Patch("vllm.v1.worker.utils:AttentionGroup", "_kv_group_lengths", "added on an instance", (),
          "the KV cache group whose own seq_lens the wrapped build_metadata substitutes (it is not told its group)",
          "harness.engine.worker_patch.GroupLengths"),
    Patch("vllm.v1.attention.backend:CommonAttentionMetadata", "replace", "called", ("self", "kwargs"),
          "called to give a layer group its own seq_lens in a copy of the step's common metadata",
          "harness.engine.worker_patch.GroupLengths.substitute"),
    Patch(ATTENTION, "forward", "replaced on an instance", ATTENTION_PARAMETERS,
          "during KVzip's reconstruction passes only, each attention layer runs PyTorch attention over the "
          "request's context K/V and the pass's own, scoring the context (put back after every pass)",
          "harness.engine.reconstruction.Reconstruction._forward"),
    Patch(ATTENTION, "forward", "hooked on an instance", ATTENTION_PARAMETERS,
          "a forward pre-hook on each attention layer copies the step's newest queries (the first argument, "
          "post-RoPE [tokens, heads * head_size]) for attention-aware policies' windows",
          "harness.engine.query_capture.QueryCapture"),
    # The requests' parameters.
    Patch(SAMPLING_PARAMS, "extra_args", "field set on an instance", (),
          "a KVzip request's reconstruction ids written into its own eviction settings, where the scheduler reads them",
          "harness.engine.frontend.check_request"),
    Patch(SAMPLING_PARAMS, "output_kind", "field set on an instance", (),
          "the shared-prefill driver's requests return their final output only",
          "harness.engine.shared_prefill.generate_shared"),
    # KV cache groups per layer group: vLLM asks each layer's spec whether it merges with the others.
    Patch("vllm.v1.kv_cache_interface:FullAttentionSpec", "merge", "overridden", ("specs",),
          "refuse to merge two budget groups' layers, and keep the group's tag through vLLM's merge",
          "harness.engine.layer_groups.BudgetGroupSpec"),
    Patch("vllm.v1.kv_cache_interface:FullAttentionSpec", "is_uniform_with_collection", "overridden",
          ("self", "kv_cache_specs"),
          "layers of two budget groups are not one uniform type, so vLLM forms a KV cache group per budget group",
          "harness.engine.layer_groups.BudgetGroupSpec"),
    # Forced decoding (the likelihood scorer): vLLM's custom logits-processor interface, loaded by name.
    Patch(LOGITS_PROCESSOR, "__init__", "implemented", ("self", "vllm_config", "device", "is_pin_memory"),
          "vLLM builds the processor with these", "harness.engine.forced_decoding.ForcedTokens"),
    Patch(LOGITS_PROCESSOR, "validate_params", "implemented", ("sampling_params",),
          "refuse a request's forced tokens that cannot apply", "harness.engine.forced_decoding.ForcedTokens"),
    Patch(LOGITS_PROCESSOR, "is_argmax_invariant", "implemented", ("self",),
          "forcing tokens changes the argmax", "harness.engine.forced_decoding.ForcedTokens"),
    Patch(LOGITS_PROCESSOR, "update_state", "implemented", ("self", "batch_update"),
          "follow the batch's requests and their forced tokens", "harness.engine.forced_decoding.ForcedTokens"),
    Patch(LOGITS_PROCESSOR, "apply", "implemented", ("self", "logits"),
          "force each row's next token", "harness.engine.forced_decoding.ForcedTokens"),
)

_INSTALLED = "_kv_eviction_patched"


def install() -> None:
    """Install every ``wrapped`` and ``added`` patch (once per process; the others are installed by
    the subclasses vLLM's hooks bring)."""
    for patch in PATCHES:
        if patch.make is None:
            continue
        owner = patch.owner_class()
        done = owner.__dict__.get(_INSTALLED, set())
        if patch.name in done:
            continue
        setattr(owner, patch.name, patch.make(getattr(owner, patch.name, None)))
        setattr(owner, _INSTALLED, done | {patch.name})


def installed(owner, name: str) -> bool:
    """Whether ``install()`` has patched ``owner.name`` in this process."""
    return name in owner.__dict__.get(_INSTALLED, set())


# One vLLM object changed: the only writes to a vLLM object's attributes outside this file go
# through these, and each refuses a name PATCHES does not list for one object. (By name only: the
# harness's unit tests hand them stand-ins for vLLM's objects.)

_ON_AN_INSTANCE = frozenset(patch.name for patch in PATCHES if patch.how in INSTANCE_KINDS
                            and patch.how != "hooked on an instance")
_SWAPPED_IN = frozenset(patch.by for patch in PATCHES if patch.how == "class swapped on an instance")
_ABSENT = object()


def _listed(name: str) -> None:
    if name not in _ON_AN_INSTANCE:
        raise RuntimeError(f"{name!r} is not listed for one object in harness.engine.patches.PATCHES: list it there "
                           "(the vLLM class, how, its parameters, why)")


def set_on(obj, name: str, value) -> None:
    """Set attribute ``name`` of one vLLM object to ``value`` (a listed ``added``, ``field set`` or
    ``replaced on an instance`` patch)."""
    _listed(name)
    setattr(obj, name, value)


def take_from(obj, name: str):
    """Remove one object's own ``name`` (a replaced method falls back to its class's), returning what
    it held; None where it held nothing."""
    _listed(name)
    return vars(obj).pop(name, None)


@contextmanager
def replaced_on(obj, name: str, value) -> Iterator[None]:
    """``obj.name`` is ``value`` inside the block; afterwards what the object had (its class's
    where it had none of its own)."""
    _listed(name)
    own = vars(obj).get(name, _ABSENT)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, own)


def swap_class(obj, cls: type) -> None:
    """Make one vLLM object an instance of ``cls``, the harness's direct subclass of its class that
    PATCHES lists: the object keeps its state, its methods become the subclass's."""
    _listed("__class__")
    if f"{cls.__module__}.{cls.__qualname__}" not in _SWAPPED_IN or cls.__bases__ != (type(obj),):
        raise TypeError(f"{cls.__qualname__} is not a listed direct subclass of {type(obj).__qualname__}")
    obj.__class__ = cls

"""Every place the harness changes vLLM 0.32.0, in one list, installed from here.

vLLM's own extension points carry what they can: the general plugin (``harness.engine.plugin``,
which calls ``install()`` in every vLLM process) and ``scheduler_cls``
(``harness.engine.scheduler.EvictionScheduler``). What they cannot reach is patched, and each patch
is a ``Patch`` below: the vLLM name it touches, how, the parameters that name has in vLLM 0.32.0,
and why. ``tests/unit/test_vllm_patches.py`` checks every name and its parameters against the
installed vLLM, so an upgrade that moves one fails there, by name, before any engine starts.

How a name is touched:

* ``wrapped``: the method is replaced, on vLLM's class, by one that calls vLLM's own (installed here);
* ``added``: a new attribute on vLLM's class (installed here; the name must not exist in vLLM);
* ``overridden``: a subclass of the harness redefines it (vLLM's hook installs the subclass: the
  scheduler through ``scheduler_cls``; the KV managers by swapping an instance's class);
* ``replaced on an instance``: one object's method, set on that object only (the scheduler's own
  KV cache manager);
* ``called``: not changed, but called by the harness where vLLM itself calls it (its parameters
  are a contract all the same).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
MANAGER = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"


@dataclass(frozen=True)
class Patch:
    owner: str                      # "module:Class" in vLLM
    name: str                       # the attribute touched
    how: str                        # wrapped, added, overridden, replaced on an instance, called
    parameters: tuple[str, ...]     # vLLM 0.32.0's own (empty for an added name)
    why: str
    by: str                         # the harness code that does it
    make: Callable | None = None    # wrapped: vLLM's method -> the wrapper; added: the attribute

    @property
    def target(self) -> str:
        return f"{self.owner}.{self.name}"

    def owner_class(self):
        module, qualname = self.owner.split(":")
        return getattr(importlib.import_module(module), qualname)


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
          "run the step's evictions once its K/V are written, and attach the report to the runner's output",
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
    # The engine core: utilities are looked up by name (vllm/v1/engine/core.py, call_utility).
    Patch("vllm.v1.engine.core:EngineCore", "kv_eviction_state", "added", (),
          "let a client read the scheduler's eviction ledger and per-request counters in any process layout",
          "harness.engine.frontend.kv_eviction_state",
          lambda _absent: importlib.import_module("harness.engine.frontend").kv_eviction_state),
    # The scheduler, through scheduler_cls: public methods extended, three private ones overridden.
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
          "drop the shared compressed contexts with the prefix cache", "harness.engine.scheduler.EvictionScheduler"),
    # The scheduler's KV managers: each instance's class swapped to a subclass sized by physical length.
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

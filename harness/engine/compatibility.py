"""What eviction needs of a vLLM engine, checked before it serves: its scheduler, a KV cache dtype the
harness reads exactly, no parallelism but tensor parallelism, no speculative decoding, the V1 model runner. (What a policy needs of the engine, eager mode when it
captures attention queries, is ``harness.eviction.settings.check_policy_runs``: the config checks it too.)"""
from __future__ import annotations

# Where an engine's layer_groups travels to every vLLM process (engine core, workers): vLLM's own
# ``additional_config``, as the eviction default does (harness.engine.layer_groups).
LAYER_GROUPS_KEY = "kv_layer_groups"
# vLLM's scheduler hook (--scheduler-cls / scheduler_cls) must name this class when eviction is on.
SCHEDULER_CLS = "harness.engine.scheduler.EvictionScheduler"
# KV cache dtypes whose K/V the harness reads and copies exactly ("auto" = the model's dtype).
# fp8 caches hold scaled 8-bit values: scores would need the scales, so they are refused.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")
# How the message of a request the scheduler refused on arrival starts (its backstop, where the
# frontend did not refuse it: harness.engine.scheduler.EvictionScheduler.add_request).
REFUSED = "kv_eviction refused the request: "


def uses_eviction_scheduler(scheduler_cls) -> bool:
    """Whether vLLM's ``scheduler_cls`` setting (a dotted name or a class) is the eviction scheduler."""
    if isinstance(scheduler_cls, str):
        return scheduler_cls == SCHEDULER_CLS
    return any(f"{c.__module__}.{c.__qualname__}" == SCHEDULER_CLS for c in getattr(scheduler_cls, "__mro__", ()))


def layer_groups_of(vllm_config) -> int:
    """The engine's ``layer_groups`` G (1 when not set)."""
    return int((getattr(vllm_config, "additional_config", None) or {}).get(LAYER_GROUPS_KEY, 1))


def check_compatible(vllm_config) -> None:
    """Engine features eviction cannot coexist with, refused with the reason (before serving)."""
    cache = vllm_config.cache_config
    if not uses_eviction_scheduler(vllm_config.scheduler_config.scheduler_cls):
        raise ValueError(
            f"KV eviction needs its scheduler, got scheduler_cls={vllm_config.scheduler_config.scheduler_cls!r}: "
            f"pass --scheduler-cls {SCHEDULER_CLS} (LLM(scheduler_cls=...) in Python)"
        )
    if str(cache.cache_dtype) not in KV_CACHE_DTYPES:
        raise ValueError(
            f"KV eviction cannot read a {cache.cache_dtype} KV cache (scaled 8-bit values); "
            f"supported kv_cache_dtype: {', '.join(KV_CACHE_DTYPES)}"
        )
    check_parallel(vllm_config.parallel_config)
    if vllm_config.speculative_config is not None:
        raise ValueError("KV eviction does not support speculative decoding")
    if vllm_config.use_v2_model_runner:
        raise ValueError(
            "KV eviction patches vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0 "
            "(Model Runner V2 builds positions and seq_lens in one GPU kernel)"
        )


# Parallel forms besides tensor parallelism, and why eviction cannot follow them: each would need
# the ranks' decisions combined along another axis than the KV heads (harness.eviction.shards).
OTHER_PARALLELISM = {
    "pipeline_parallel_size": "each pipeline stage holds some layers, and a block's score spans all of them",
    "prefill_context_parallel_size": "a request's tokens are split across ranks",
    "decode_context_parallel_size": "a request's tokens are split across ranks",
    "data_parallel_size": "each replica has its own scheduler; not tested with eviction",
}


def check_parallel(parallel) -> None:
    """Tensor parallelism only: every rank holds a share of every layer's heads for all of a
    request's tokens. vLLM's world size counts pipeline and prefill-context ranks too
    (``vllm/config/parallel.py:945-949``), decode context parallelism splits tokens inside the
    tensor-parallel group (``:385``)."""
    for name, why in OTHER_PARALLELISM.items():
        size = getattr(parallel, name, 1)
        if size > 1:
            raise ValueError(f"KV eviction runs under tensor parallelism only, got {name}={size}: {why}")
    if parallel.world_size != parallel.tensor_parallel_size:
        raise ValueError(f"KV eviction runs under tensor parallelism only: vLLM's world size is {parallel.world_size} "
                         f"for tensor_parallel_size={parallel.tensor_parallel_size}")



def prefix_cache_unreachable(*, prefix_caching: bool, connector: bool, skips_prefix_cache: bool) -> str | None:
    """Why a request cannot take a compressed context or a chained turn, which reach it only through
    vLLM's prefix-cache hits, on this engine (None: it can). Said alike by the frontend, which
    refuses a ``share_context=true`` or ``chain=true`` request for it with HTTP 400
    (``harness.engine.frontend.check_request``), and by the scheduler, which then does not share
    (``share_context`` left unset) or, as the backstop, ends the request with the reason."""
    if not prefix_caching:
        return "this engine takes no prefix-cache hits (prefix caching is off): start it with prefix caching on"
    if connector:
        # a connector may load a pristine copy of blocks whose hash the compressed entry also answers to
        # (the scheduler builds one from kv_transfer_config: vllm/v1/core/sched/scheduler.py:171-180)
        return ("this engine has a KV connector, which could load a pristine copy where a compressed one is "
                "expected: serve without one")
    if skips_prefix_cache:
        # vLLM sets skip_reading_prefix_cache for a request asking prompt log-probabilities (or the
        # log-probabilities of given prompt tokens), unless the request sets it itself
        # (vllm/sampling_params.py:622-629; read as Request.skip_reading_prefix_cache, vllm/v1/request.py:314-325)
        return ("the request skips the prefix cache (it asks for prompt log-probabilities, or sets "
                "skip_reading_prefix_cache): ask for them without share_context or chain")
    return None


def prefix_cache_refusal(settings, *, prefix_caching: bool, connector: bool, skips_prefix_cache: bool) -> str | None:
    """The refusal of settings that insist on the prefix cache (``share_context=true``, ``chain=true``)
    for a request that cannot reach it here (``prefix_cache_unreachable``); None where they do not
    insist, or it can."""
    reason = prefix_cache_unreachable(prefix_caching=prefix_caching, connector=connector,
                                      skips_prefix_cache=skips_prefix_cache)
    if reason is None:
        return None
    if settings.share_context:
        return f"share_context=true: a compressed context reaches later requests through vLLM's prefix-cache hits, but {reason}"
    if settings.chain:
        return f"chain=true: a turn's compressed cache reaches the next turn through vLLM's prefix-cache hits, but {reason}"
    return None

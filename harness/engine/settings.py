"""Eviction settings as vLLM carries them: ``additional_config={"kv_eviction": {...}}``.

The same dict works from Python (``LLM(additional_config=...)``) and from the command line
(``vllm serve MODEL --additional-config '{"kv_eviction": {"policy": "paged", "budget": 512}}'``).
Every vLLM process (scheduler and workers) reads it from its own ``vllm_config``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from policies import Policy, make_policy

CONFIG_KEY = "kv_eviction"
# vLLM's scheduler hook (--scheduler-cls / scheduler_cls) must name this class when eviction is on.
SCHEDULER_CLS = "harness.engine.scheduler.EvictionScheduler"
# KV cache dtypes whose K/V the harness reads and copies exactly ("auto" = the model's dtype).
# fp8 caches hold scaled 8-bit values: scores would need the scales, so they are refused.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass(frozen=True)
class EvictionSettings:
    policy: str
    budget: int
    options: dict = field(default_factory=dict)

    def as_additional_config(self) -> dict:
        return {CONFIG_KEY: {"policy": self.policy, "budget": self.budget, "options": dict(self.options)}}


def settings_from(vllm_config) -> EvictionSettings | None:
    """The engine's eviction settings, or None when eviction is off (stock vLLM behaviour)."""
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    if not raw or raw.get("policy", "full") == "full":
        return None
    unknown = set(raw) - {"policy", "budget", "options"}
    if unknown:
        raise ValueError(f"{CONFIG_KEY} has unknown key(s) {sorted(unknown)}; valid: policy, budget, options")
    if "budget" not in raw:
        raise ValueError(f"{CONFIG_KEY} needs a 'budget' (KV tokens kept per request)")
    return EvictionSettings(raw["policy"], int(raw["budget"]), dict(raw.get("options") or {}))


def build_policy(settings: EvictionSettings, block_size: int) -> Policy:
    return make_policy(settings.policy, settings.budget, block_size, **settings.options)


def uses_eviction_scheduler(scheduler_cls) -> bool:
    """Whether vLLM's ``scheduler_cls`` setting (a dotted name or a class) is the eviction scheduler."""
    if isinstance(scheduler_cls, str):
        return scheduler_cls == SCHEDULER_CLS
    return any(f"{c.__module__}.{c.__qualname__}" == SCHEDULER_CLS for c in getattr(scheduler_cls, "__mro__", ()))


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
    if cache.enable_prefix_caching:
        raise ValueError(
            "KV eviction cannot run with prefix caching: compacted or evicted blocks no longer hold "
            "the tokens their hashes describe. Turn prefix caching off (--no-enable-prefix-caching)."
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        raise ValueError("KV eviction supports one worker (tensor and pipeline parallel size 1)")
    if vllm_config.speculative_config is not None:
        raise ValueError("KV eviction does not support speculative decoding")
    if vllm_config.use_v2_model_runner:
        raise ValueError(
            "KV eviction patches vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0 "
            "(Model Runner V2 builds positions and seq_lens in one GPU kernel)"
        )
    # Left unset, vLLM 0.32 turns asynchronous scheduling on where the executor supports it (the
    # GPU default; vllm/config/vllm.py:1585): `vllm serve` on a GPU needs --no-async-scheduling.
    if vllm_config.scheduler_config.async_scheduling:
        raise ValueError(
            "KV eviction needs synchronous scheduling (a step's evictions reach the next schedule): "
            "pass --no-async-scheduling"
        )

"""Eviction settings as vLLM carries them: ``additional_config={"kv_eviction": {...}}``.

The same dict works from Python (``LLM(additional_config=...)``) and from the command line
(``vllm serve MODEL --additional-config '{"kv_eviction": {"policy": "paged", "budget": 512}}'``).
Every vLLM process (scheduler and workers) reads it from its own ``vllm_config``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from policies import Policy, make_policy

CONFIG_KEY = "kv_eviction"


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


def check_compatible(vllm_config) -> None:
    """Engine features eviction cannot coexist with, refused with the reason (before serving)."""
    cache = vllm_config.cache_config
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
    if vllm_config.scheduler_config.async_scheduling:
        raise ValueError(
            "KV eviction needs synchronous scheduling (a step's evictions reach the next schedule): "
            "pass --no-async-scheduling"
        )

"""Eviction settings as vLLM carries them, engine-wide and per request.

Engine-wide (the default of every request): ``additional_config={"kv_eviction": {...}}``, from
Python (``LLM(additional_config=...)``) or the command line (``vllm serve MODEL --additional-config
'{"kv_eviction": {"policy": "paged", "budget": 512}}'``); every vLLM process reads it from its own
``vllm_config``.

Per request: the same dict under ``SamplingParams.extra_args["kv_eviction"]`` (offline), or as a
JSON string under ``vllm_xargs`` in an OpenAI request (vLLM copies ``vllm_xargs`` into
``extra_args``; its values may only be strings and numbers: ``entrypoints/openai/completion/
protocol.py:250,379``). ``{"policy": "full"}`` turns eviction off for that request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json

from policies import BudgetError, Policy, UnknownPolicyError, make_policy

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

    def as_dict(self) -> dict:
        return {"policy": self.policy, "budget": self.budget, "options": dict(self.options)}

    def as_additional_config(self) -> dict:
        return {CONFIG_KEY: self.as_dict()}

    def as_extra_args(self) -> dict:
        """``SamplingParams.extra_args`` that give one request these settings."""
        return {CONFIG_KEY: self.as_dict()}

    @property
    def key(self) -> tuple:
        """Hashable identity (policies are built once per distinct settings)."""
        return self.policy, self.budget, json.dumps(self.options, sort_keys=True)  # options may nest (hybrid's weights)


# The settings of a request that keeps its whole cache, whatever the engine's default.
NO_EVICTION = {"policy": "full"}


def policy_options(cfg) -> dict:
    """A Hydra config's ``policy.options`` as plain Python (nested values included)."""
    from omegaconf import OmegaConf

    options = cfg.policy.get("options")
    return OmegaConf.to_container(options, resolve=True) if options is not None else {}


def parse_settings(raw, where: str) -> EvictionSettings | None:
    """``{policy, budget, options}`` (or its JSON text) as settings; None for ``policy: full``."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error.msg}): {raw!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping with policy, budget and options; got {raw!r}")
    unknown = set(raw) - {"policy", "budget", "options"}
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}; valid: policy, budget, options")
    if raw.get("policy", "full") == "full":
        return None
    budget = raw.get("budget")
    if budget is None:
        raise ValueError(f"{where} needs a 'budget' (KV tokens kept per request)")
    if isinstance(budget, bool) or not isinstance(budget, int) and not (isinstance(budget, str) and budget.isdigit()):
        raise ValueError(f"{where}: budget must be an integer number of tokens, got {budget!r}")
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"{where}: options must be a mapping, got {options!r}")
    return EvictionSettings(str(raw["policy"]), int(budget), dict(options))


def settings_from(vllm_config) -> EvictionSettings | None:
    """The engine's default eviction settings, or None when eviction is off by default."""
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    if not raw:
        return None
    return parse_settings(raw, CONFIG_KEY)


def request_settings(extra_args: dict | None, default: EvictionSettings | None, block_size: int
                     ) -> EvictionSettings | None:
    """One request's eviction settings: its own ``extra_args["kv_eviction"]`` or the engine default.

    Raises ``ValueError`` naming what is wrong and what is allowed (unknown policy or option,
    budget not a block multiple): the request is refused at admission."""
    if not extra_args or CONFIG_KEY not in extra_args:
        return default
    settings = parse_settings(extra_args[CONFIG_KEY], f"request {CONFIG_KEY}")
    if settings is not None:
        try:
            build_policy(settings, block_size)
        except (BudgetError, UnknownPolicyError, TypeError, ValueError) as error:
            raise ValueError(f"request {CONFIG_KEY}: {error}") from None
    return settings


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


def check_policy_runs(policy: Policy, enforce_eager: bool) -> None:
    """What a policy needs of the engine beyond eviction itself: an attention-aware policy's query
    window is copied by Python hooks on the attention layers, which compiled graphs skip."""
    if policy.query_window and not enforce_eager:
        raise ValueError(
            f"{policy.name} reads attention queries through hooks that compiled graphs skip: "
            "run with enforce_eager (engine.enforce_eager=true, vllm serve --enforce-eager)")

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

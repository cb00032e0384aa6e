"""Everything wrong with a config is found here, in milliseconds, before any model loads.

Hydra already rejects unknown config groups (``policy=h2o``) and lists the choices; this module
checks what Hydra cannot: budgets against block size and context, block sizes against the
backend, policy options, data paths and limits, model paths.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.data import DataError, check_data_config
from harness.engine.settings import check_policy_runs, policy_options
from harness.models import ModelNotFoundError, kv_bytes_per_token, resolve_model_path
from policies import REGISTRY, BudgetError, UnknownPolicyError, check_budget, make_policy

DEVICES = {"cpu": 32, "cuda": 16}  # device -> the block size multiple its attention backend needs


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what is wrong and what is allowed."""


def validate(cfg: DictConfig) -> None:
    try:
        _validate(cfg)
    except (BudgetError, UnknownPolicyError, DataError, ModelNotFoundError) as error:
        raise ConfigError(str(error)) from None


def _validate(cfg: DictConfig) -> None:
    device = cfg.engine.device
    if device not in DEVICES:
        raise ConfigError(f"unknown engine.device {device!r}; valid: {', '.join(DEVICES)}")
    multiple = DEVICES[device]
    if not isinstance(cfg.block_size, int) or cfg.block_size < 1 or cfg.block_size % multiple:
        raise ConfigError(
            f"block_size={cfg.block_size} cannot be used on {device}: its attention backend needs a "
            f"positive multiple of {multiple}"
        )
    if cfg.policy.name not in REGISTRY:
        raise ConfigError(f"unknown policy {cfg.policy.name!r}; valid: {', '.join(REGISTRY)}")
    # Full cache ignores the budget, but a budget no policy could use is a typo: refuse it too.
    check_budget(cfg.budget, cfg.block_size)
    if cfg.policy.name != "full":
        try:
            policy = make_policy(cfg.policy.name, cfg.budget, cfg.block_size, **policy_options(cfg))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"policy {cfg.policy.name}: {error}") from None
        try:
            check_policy_runs(policy, cfg.engine.enforce_eager)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if cfg.budget > cfg.model.max_model_len:
        raise ConfigError(
            f"budget={cfg.budget} is above model {cfg.model.name}'s context of "
            f"{cfg.model.max_model_len} tokens"
        )
    if device == "cuda" and str(cfg.model.dtype) not in ("bfloat16", "float16"):
        # FlashAttention (the GPU layout the harness reads) accepts only half precision; vLLM
        # would silently pick the Triton backend for float32 (flash_attn.py:287 supported_dtypes).
        raise ConfigError(
            f"model.dtype={cfg.model.dtype} cannot run on the GPU engine: FlashAttention, whose KV layout "
            "the harness reads, needs bfloat16 or float16"
        )
    check_data_config(cfg.data)
    if not str(cfg.model.path).startswith("embedded:"):
        resolve_model_path(str(cfg.model.path), prepare=False)
    check_kv_pool(cfg)


def check_kv_pool(cfg: DictConfig) -> None:
    """vLLM refuses to start when its KV pool cannot hold one request of ``max_model_len`` tokens;
    say so here, in the harness's terms, before a model loads."""
    try:
        model_dir = resolve_model_path(str(cfg.model.path), prepare=False)
    except ModelNotFoundError:
        return  # not prepared yet: the engine will prepare it and vLLM checks the pool
    per_token = kv_bytes_per_token(model_dir, str(cfg.model.dtype))
    blocks = cfg.engine.get("num_kv_blocks")
    gib = cfg.engine.get("kv_cache_gib")
    if blocks is None and (gib is None or per_token is None):
        return  # vLLM sizes the pool from free device memory
    if blocks is None:
        blocks = int(gib * 2**30 // (per_token * cfg.block_size))
        source = f"engine.kv_cache_gib={gib} ({blocks} blocks of {cfg.block_size} tokens)"
    else:
        source = f"engine.num_kv_blocks={blocks} (of {cfg.block_size} tokens)"
    need = -(-cfg.model.max_model_len // cfg.block_size)
    if blocks < need:
        hint = (f"raise engine.kv_cache_gib to at least {need * cfg.block_size * per_token / 2**30:.3f}"
                if per_token else "raise engine.num_kv_blocks")
        raise ConfigError(
            f"the KV pool of {source} holds {blocks * cfg.block_size} tokens, but one request of model "
            f"{cfg.model.name} may need max_model_len={cfg.model.max_model_len} tokens ({need} blocks): "
            f"{hint} or lower model.max_model_len"
        )


def identity(cfg: DictConfig) -> dict:
    """What makes two runs the same cell. Full cache ignores the budget: it runs once per model and data."""
    policy = OmegaConf.to_container(cfg.policy, resolve=True)
    options = policy.get("options") or {}
    if cfg.policy.name in REGISTRY and options.get("granularity", object()) == REGISTRY[cfg.policy.name].granularity:
        # A policy's own granularity names the cell it named before granularity became an option.
        policy["options"] = {k: v for k, v in options.items() if k != "granularity"}
    keys = {
        "policy": policy,
        "budget": None if cfg.policy.name == "full" else cfg.budget,
        "block_size": cfg.block_size,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "engine": OmegaConf.to_container(cfg.engine, resolve=True),
    }
    return keys


def cell_name(cfg: DictConfig) -> str:
    digest = hashlib.sha256(json.dumps(identity(cfg), sort_keys=True).encode()).hexdigest()[:8]
    label = "full" if cfg.policy.name == "full" else f"{cfg.policy.name}_b{cfg.budget}"
    return f"{label}_bs{cfg.block_size}_{digest}"


def full_cache_twin(cfg: DictConfig) -> DictConfig:
    """The same cell with full cache: the reference a policy's fidelity is measured against."""
    twin = cfg.copy()
    twin.policy = OmegaConf.create({"name": "full", "options": {}})
    return twin


def run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / cfg.model.name / cfg.data.name / cell_name(cfg)

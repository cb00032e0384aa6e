"""What each eviction setting may hold: the field checks of the one parse (``harness.eviction.settings``).

Each check takes the value given (or the field's default) and ``given``, the settings checked before
it in the record's field order (by name), and returns the value the record holds, or raises
``ValueError`` with one line saying what is wrong and what is allowed (the parse names where the
settings came from in front of it). The record declares each field's check beside the field
(``EvictionSettings``); ``parse_settings`` runs them in that order for every path: a request's
``extra_args`` and an engine's ``additional_config``, a Hydra run, a sweep's cells, the benchmark's
cells and a batch_run spec. What needs the engine (block size, layer groups, eager mode) is
``harness.eviction.admission``'s.
"""
from __future__ import annotations

import math

from policies import REGISTRY, UnknownPolicyError

PYRAMID_BETA = 20.0  # kvpress 0.5.5's PyramidKVPress default
COMPRESS = ("prompt", "context")
ENGINE_SCHEDULES = ("uniform", "pyramid", "attention", "kvzip")
# The schedules whose group budgets each request measures in its eviction step (``measuring``).
MEASURED_SCHEDULES = ("attention", "kvzip")


def check_policy(policy, given: dict) -> str:
    """A policy's registered name (``policies.REGISTRY``, "full" among them); its options are checked
    where the policy is built (``harness.eviction.admission.build_policy``)."""
    policy = str(policy)
    if policy not in REGISTRY:
        raise UnknownPolicyError(f"unknown policy {policy!r}; valid: {', '.join(REGISTRY)}")
    return policy


def check_budget(budget, given: dict) -> int | None:
    """KV tokens kept per request (its multiple of the block size is the admission's check)."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) and not (isinstance(budget, str) and budget.isdigit()):
        raise ValueError(f"budget must be an integer number of tokens, got {budget!r}")
    return int(budget)


def check_options(options, given: dict) -> dict:
    options = options or {}
    if not isinstance(options, dict):
        raise ValueError(f"options must be a mapping, got {options!r}")
    return dict(options)


def check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ValueError(f"budget_ratio is the share of the prompt removed, a number in [0, 1); got {ratio!r}")
    return float(ratio)


def check_budget_ratio(ratio, given: dict) -> float | None:
    """The share of each prompt (or context) removed, instead of a budget (never beside one)."""
    if ratio is None:
        return None
    ratio = check_ratio(ratio)
    if given["budget"] is not None:
        raise ValueError(f"budget_ratio={ratio:g} sets each request's budget from its prompt: pass budget=null with it "
                         f"(budget={given['budget']} was also given); a budget or a budget_ratio, exactly one of them")
    return ratio


def check_decode_eviction(decode, given: dict) -> bool:
    if not isinstance(decode, bool):
        raise ValueError(f"decode_eviction must be true or false, got {decode!r}")
    return decode


def check_compress(compress, given: dict) -> str:
    """Where the prefill eviction runs; the context is compressed once (no decode eviction after it)."""
    if compress not in COMPRESS:
        raise ValueError(f"compress must be one of {', '.join(COMPRESS)} (where the prefill eviction runs: after the "
                         f"whole prompt, or at the end of the context), got {compress!r}")
    if compress == "context" and given["decode_eviction"] and given["policy"] != "full":
        raise ValueError("compress=context compresses the context once, before the question (kvpress's query-agnostic "
                         "setting); pass decode_eviction=false with it")
    return compress


def check_context_tokens(context_tokens, given: dict) -> int | None:
    """A request's own context boundary (a run gives none: each request brings its own)."""
    if context_tokens is None:
        return None
    if given["compress"] != "context":
        raise ValueError("context_tokens is the boundary compress=context evicts at; it needs compress=context")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens must be a positive number of tokens, got {context_tokens!r}")
    return context_tokens


def check_budget_schedule(schedule, given: dict) -> str:
    if schedule not in ENGINE_SCHEDULES:
        raise ValueError(f"budget_schedule must be one of {', '.join(ENGINE_SCHEDULES)}, got {schedule!r}")
    return schedule


def check_pyramid_beta(beta, given: dict) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 1:
        raise ValueError(f"pyramid_beta is the pyramid's slope, a number >= 1 (1 is flat), got {beta!r}")
    if beta != PYRAMID_BETA and given["budget_schedule"] != "pyramid":
        raise ValueError(f"pyramid_beta shapes budget_schedule=pyramid; this one is {given['budget_schedule']}")
    return float(beta)


def unshareable(compress: str, schedule: str) -> str | None:
    """Why settings' compressed contexts cannot be shared exactly, or None where they can."""
    if compress != "context":
        return ("compress=prompt keeps what the question attends to (query-aware): the kept set is the "
                "request's own, so no other request can take it")
    if schedule in MEASURED_SCHEDULES:
        return (f"budget_schedule={schedule} measures each request's layer budgets from its own prompt "
                "(its eviction step's report), which a request taking a shared context would not have")
    return None


def check_share_context(share, given: dict) -> bool | None:
    if share is not None and not isinstance(share, bool):
        raise ValueError(f"share_context must be true, false or null (share where exact), got {share!r}")
    reason = unshareable(given["compress"], given["budget_schedule"]) if share else None
    if reason:
        raise ValueError(f"share_context=true, but {reason}")
    return share


def check_chain(chain, given: dict) -> bool:
    """``chain`` against the settings it carries a turn's state under (the policy's own limits:
    ``admission.check_chain_policy``; the engine's: the scheduler and the frontend)."""
    if not isinstance(chain, bool):
        raise ValueError(f"chain must be true or false, got {chain!r}")
    if chain and given["compress"] != "context":
        raise ValueError("chain=true carries a turn's compressed context into the next turn; it needs "
                         "compress=context (the history compressed before each new message)")
    if chain and given["budget_schedule"] == "attention":
        raise ValueError("chain=true, but budget_schedule=attention measures each request's layer budgets from its "
                         "own prompt's queries, which a turn continuing a compressed history does not have")
    return chain


def check_protect_prefix(prefix, given: dict) -> int:
    """The request's first tokens never evicted; what the budget must leave beside them is the
    policy's (``policies.base.Policy.check_carried``, at admission: it needs the block size)."""
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"protect_prefix is how many of the request's first tokens are never evicted, an integer "
                         f">= 0; got {prefix!r}")
    return prefix

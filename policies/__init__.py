"""The policy zoo: pure PyTorch, no vLLM.

Every module of this package registers what it defines (``policies.registry``) when the package is
imported, so adding a policy is one file: a score function or ``Score`` dataclass with
``@register_score`` (``policies/value_norm.py``), or a rule of its own with ``@register_policy``.
A score kept outside this package registers the same way from its own module, named in
``KVH_POLICY_MODULES`` (comma-separated import paths): every process that imports ``policies``
(``run.py``, ``vllm serve``'s frontend, engine core and workers) then knows it.
"""
from __future__ import annotations

import importlib
import os
import pkgutil

from policies.base import BlockPolicy, BudgetError, Policy, TokenPolicy, check_budget
from policies.registry import REGISTRY, UnknownPolicyError, default_options, make_policy
from policies.score import Score
from policies.selection import ScoredBlockPolicy, ScoredTokenPolicy

# Modules that define no policy; every other module registers one.
_FRAMEWORK = {"base", "registry", "score", "selection", "attention", "budget_schedules"}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _FRAMEWORK:
        importlib.import_module(f"policies.{_module}")
for _module in filter(None, (name.strip() for name in os.environ.get("KVH_POLICY_MODULES", "").split(","))):
    importlib.import_module(_module)

__all__ = [
    "REGISTRY", "BlockPolicy", "BudgetError", "Policy", "Score", "ScoredBlockPolicy", "ScoredTokenPolicy",
    "TokenPolicy", "UnknownPolicyError", "check_budget", "default_options", "make_policy",
]

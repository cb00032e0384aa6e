"""The policy zoo: pure PyTorch, no vLLM. A Hydra name maps to a class here.

Adding a policy: write ``policies/<name>.py`` with a dataclass subclassing ``ScoredBlockPolicy`` or
``ScoredTokenPolicy`` (a score, selection inherited) or ``BlockPolicy`` / ``TokenPolicy``, and add
one line to ``REGISTRY`` (plus ``conf/policy/<name>.yaml`` for Hydra).
"""
from __future__ import annotations

from typing import Any

from policies.base import BlockPolicy, BudgetError, Policy, ScoredBlockPolicy, ScoredTokenPolicy, TokenPolicy, check_budget
from policies.full import FullCache
from policies.h2o import H2O
from policies.keydiff import KeyDiff, KeyDiffBlocks
from policies.knorm import InverseKeyNorm, InverseKeyNormBlocks
from policies.paged import PagedEviction, ValueKeyRatioTokens
from policies.snapkv import SnapKV, SnapKVBlocks
from policies.streaming import StreamingLLM
from policies.tova import TOVA

REGISTRY: dict[str, type[Policy]] = {
    "full": FullCache,
    "paged": PagedEviction,
    "streaming": StreamingLLM,
    "knorm": InverseKeyNorm,
    "keydiff": KeyDiff,
    # Attention-aware: scores from an observation window of each request's newest queries.
    "snapkv": SnapKV,
    "h2o": H2O,
    "tova": TOVA,
    # Each score at the other granularity (score and granularity apart, for ablations).
    "paged_token": ValueKeyRatioTokens,
    "knorm_block": InverseKeyNormBlocks,
    "keydiff_block": KeyDiffBlocks,
    "snapkv_block": SnapKVBlocks,
}


class UnknownPolicyError(ValueError):
    pass


def make_policy(name: str, budget: int, block_size: int, **options: Any) -> Policy:
    """Build a policy by its Hydra name; unknown names and options fail with the valid ones."""
    if name not in REGISTRY:
        raise UnknownPolicyError(f"unknown policy {name!r}; valid: {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    fields = set(cls.__dataclass_fields__) - {"budget", "block_size"}
    unknown = set(options) - fields
    if unknown:
        raise UnknownPolicyError(
            f"policy {name!r} has no option {', '.join(sorted(unknown))}; "
            f"valid: {', '.join(sorted(fields)) or 'none'}"
        )
    return cls(budget=budget, block_size=block_size, **options)


__all__ = [
    "REGISTRY", "BlockPolicy", "BudgetError", "Policy", "ScoredBlockPolicy", "ScoredTokenPolicy", "TokenPolicy",
    "UnknownPolicyError",
    "check_budget", "make_policy",
]

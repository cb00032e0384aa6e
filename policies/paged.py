"""PagedEviction (Chitty-Venkata et al., arXiv 2509.04377): block-wise eviction scored by ||V||/||K||.

A token whose key has a small norm draws much attention, and a large value norm means a large
contribution when it does: ``||V|| / ||K||`` is an attention-free importance proxy. PagedEviction
is that score at block granularity (``ScoredBlockPolicy``): after prefill the first block, the
last ``B + L mod B`` tokens and the best ``C - 2B`` middle tokens survive; in decode, each time the
newest block fills past the budget, the lowest-scoring full block (never the first, never the
newest) leaves the block table whole, so nothing is copied. ``paged_token`` is the same score at
token granularity, selected like the token baselines (per KV head, compacting), for ablations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from policies.base import ScoredBlockPolicy, ScoredTokenPolicy, l2

EPS = 1e-6


def value_key_ratio(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[heads, tokens]`` scores ||V|| / max(||K||, eps) of one layer."""
    return (l2(values) / l2(keys).clamp_min(EPS)).T


@dataclass
class PagedEviction(ScoredBlockPolicy):
    name: ClassVar[str] = "paged"
    static_scores: ClassVar[bool] = True

    def layer_scores(self, keys, values):
        return value_key_ratio(keys, values)


@dataclass
class ValueKeyRatioTokens(ScoredTokenPolicy):
    name: ClassVar[str] = "paged_token"
    static_scores: ClassVar[bool] = True

    def layer_scores(self, keys, values):
        return value_key_ratio(keys, values)

"""Inverse key L2-norm (Devoto et al. 2024, arXiv 2406.11430): low key norm means high attention.

Keeps the tokens whose keys have the smallest L2 norm, chosen per layer and KV head as kvpress's
KnormPress does (``per_head=False`` shares one choice, averaged over heads and layers). The first
and last blocks are protected, as in the PagedEviction authors' baseline: a token evicted the step
after it was written is no baseline anyone means.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from policies.base import ScoredBlockPolicy, ScoredTokenPolicy, l2


def inverse_key_norm(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[heads, tokens]`` scores -||K|| of one layer."""
    return -l2(keys).T


@dataclass
class InverseKeyNorm(ScoredTokenPolicy):
    name: ClassVar[str] = "knorm"
    static_scores: ClassVar[bool] = True

    def layer_scores(self, keys, values):
        return inverse_key_norm(keys, values)


@dataclass
class InverseKeyNormBlocks(ScoredBlockPolicy):
    """The same score at block granularity (PagedEviction's selection), for ablations."""

    name: ClassVar[str] = "knorm_block"
    static_scores: ClassVar[bool] = True

    def layer_scores(self, keys, values):
        return inverse_key_norm(keys, values)

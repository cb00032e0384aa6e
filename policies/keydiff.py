"""KeyDiff (arXiv 2504.15364): keep the keys least similar to the average key direction.

A key pointing where the others point carries little that they do not; the score is the negative
cosine similarity of each key to the anchor, the mean of the *normalized* keys of its layer and
KV head (as the paper defines it, and kvpress's KeyDiffPress computes it). Averaging raw keys
instead would let a few long keys pull the anchor their way. Attention-free, like ||V||/||K||.
Selection (per head, first and last blocks protected) is the same as the key-norm baseline's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from policies.base import ScoredBlockPolicy, ScoredTokenPolicy


def key_diff(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[heads, tokens]`` negative cosine similarity of each key to its layer and head's anchor."""
    directions = F.normalize(keys.float(), dim=-1)
    anchor = directions.mean(dim=0, keepdim=True)
    return -F.cosine_similarity(directions, anchor, dim=-1).T


@dataclass
class KeyDiff(ScoredTokenPolicy):
    # The anchor moves with every token written: scores are recomputed at each eviction.
    name: ClassVar[str] = "keydiff"

    def layer_scores(self, keys, values):
        return key_diff(keys, values)


@dataclass
class KeyDiffBlocks(ScoredBlockPolicy):
    """The same score at block granularity (PagedEviction's selection), for ablations."""

    name: ClassVar[str] = "keydiff_block"

    def layer_scores(self, keys, values):
        return key_diff(keys, values)

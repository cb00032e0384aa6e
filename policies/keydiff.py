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

from policies.base import ScoredTokenPolicy


@dataclass
class KeyDiff(ScoredTokenPolicy):
    name: ClassVar[str] = "keydiff"

    # The anchor moves with every token written: scores are recomputed at each eviction.

    def layer_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        directions = F.normalize(keys.float(), dim=-1)
        anchor = directions.mean(dim=0, keepdim=True)
        return -F.cosine_similarity(directions, anchor, dim=-1).T

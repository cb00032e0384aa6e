"""KeyDiff (arXiv 2504.15364): keep the keys least similar to the average key.

A key close to the mean carries little that the others do not; the score is the negative cosine
similarity of each key to the mean key of its layer and head. Attention-free, like ||V||/||K||.
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

    def scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        keys = keys.float()
        anchor = keys.mean(dim=1, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1).permute(0, 2, 1)

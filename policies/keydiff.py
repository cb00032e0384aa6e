"""KeyDiff (arXiv 2504.15364): keep the keys least similar to the average key direction.

A key pointing where the others point carries little that they do not; the score is the negative
cosine similarity of each key to the anchor, the mean of the *normalized* keys of its layer and
KV head (as the paper defines it, and kvpress's KeyDiffPress computes it). Averaging raw keys
instead would let a few long keys pull the anchor their way. Attention-free, like ||V||/||K||, but
not static: the anchor moves with every token written, so scores are recomputed at each eviction.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from policies.registry import register_score


@register_score("keydiff", granularity="token", aliases={"keydiff_block": "block"})
def key_diff(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Negative cosine similarity of each key to the mean normalized key (KeyDiff): ``[heads, tokens]``."""
    directions = F.normalize(keys.float(), dim=-1)
    anchor = directions.mean(dim=0, keepdim=True)
    return -F.cosine_similarity(directions, anchor, dim=-1).T

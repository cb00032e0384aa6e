"""Inverse key L2-norm (Devoto et al. 2024, arXiv 2406.11430): low key norm means high attention.

Keeps the tokens whose keys have the smallest L2 norm, chosen per layer and KV head as kvpress's
KnormPress does (``per_head=False`` shares one choice, averaged over heads and layers). The first
and last blocks are protected, as in the PagedEviction authors' baseline: a token evicted the step
after it was written is no baseline anyone means. ``knorm_block`` is the score block-wise.
"""
from __future__ import annotations

import torch

from policies.base import l2
from policies.registry import register_score


@register_score("knorm", granularity="token", static=True, aliases={"knorm_block": "block"})
def inverse_key_norm(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """-||K|| per token (inverse key norm): ``[heads, tokens]``, the lowest key norms kept."""
    return -l2(keys).T

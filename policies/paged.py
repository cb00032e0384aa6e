"""PagedEviction (Chitty-Venkata et al., arXiv 2509.04377): block-wise eviction scored by ||V||/||K||.

A token whose key has a small norm draws much attention, and a large value norm means a large
contribution when it does: ``||V|| / ||K||`` is an attention-free importance proxy. PagedEviction
is that score at block granularity (``policies.selection.ScoredBlockPolicy``): after prefill the
first block, the last ``B + L mod B`` tokens and the best ``C - 2B`` middle tokens survive (with
the context compressed alone, ``compress=context``, the last ``B`` only: ``C`` in all, whole blocks);
in decode, each time the newest block fills past the budget, the lowest-scoring full block (never the
first, never the newest) leaves the block table whole, so nothing is copied. ``paged_token`` is the
same score at token granularity, selected like the token baselines (per KV head, compacting).
"""
from __future__ import annotations

import torch

from policies.base import l2
from policies.registry import register_score

EPS = 1e-6


@register_score("paged", granularity="block", static=True, aliases={"paged_token": "token"})
def value_key_ratio(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """||V||/||K|| per token (PagedEviction): ``[heads, tokens]``, ||K|| clamped at eps."""
    return (l2(values) / l2(keys).clamp_min(EPS)).T

"""Recency: newer tokens matter more (StreamingLLM's implicit score, as a score of its own).

A token's score is its slot in the request's cache, so the newest tokens are kept; with the first
block protected it is StreamingLLM with a block of sinks. Mostly a component of ``hybrid``.
"""
from __future__ import annotations

import torch

from policies.registry import register_score


@register_score("recency", granularity="token")
def recency(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The slot of each token (newest highest): ``[heads, tokens]``."""
    tokens, heads, _ = keys.shape
    return torch.arange(tokens, dtype=torch.float32, device=keys.device).expand(heads, -1)

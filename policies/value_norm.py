"""Value norm: keep the tokens whose values are longest.

A token's contribution to the attention output is its attention weight times its value; with the
weight unknown, ||V|| alone ranks what a token would add if attended to (the value half of
PagedEviction's ||V||/||K||, a known attention-free baseline). Static once written.
"""
from __future__ import annotations

import torch

from policies.base import l2
from policies.registry import register_score


@register_score("value_norm", granularity="token", static=True)
def value_norm(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """||V|| per token: ``[heads, tokens]``, the longest values kept."""
    return l2(values).T

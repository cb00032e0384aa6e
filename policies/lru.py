"""LRU: evict the tokens least recently used, a token being used when a query attends to it most.

A token's state is its age: how many queries ago it was last among the ``top_k`` tokens a query
attended to most (per KV head, attention averaged over the query heads that read it), or was
written. The newest-used tokens are kept; the state follows its tokens through compaction and
block drops, like H2O's totals, and every query is counted whether or not an eviction is due
(``harness.eviction.evictor.count_due``). Ranking ties (equal ages) go to the earlier token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from policies.attention import WindowScore, window_attention
from policies.base import top_tokens
from policies.registry import register_score


@register_score("lru", granularity="token")
@dataclass
class LeastRecentlyUsed(WindowScore):
    """LRU: keep the tokens most recently among a query's most attended (or written)."""

    accumulates: ClassVar[bool] = True

    # window (WindowScore): queries kept per request and layer (every query is counted)
    top_k: int = 16  # a query uses the top_k tokens it attends to most

    def __call__(self, keys, values, window=None):
        """``[kv_heads, tokens]``: for each token, 1 + the index of the newest window query that used
        it (attended to it among its top_k, or wrote it), 0 if none did."""
        attention = window_attention(window, keys).mean(dim=1)  # [kv_heads, n, tokens]
        heads, queries, tokens = attention.shape
        step = torch.arange(1, queries + 1, dtype=torch.float32, device=keys.device)
        used = torch.zeros(heads, queries, tokens, device=keys.device)
        used.scatter_(-1, top_tokens(attention, min(self.top_k, tokens)), 1.0)
        own = torch.arange(tokens - queries, tokens, device=keys.device)  # the slot each query wrote
        used[:, torch.arange(queries), own] = 1.0
        return (used * step[None, :, None]).amax(dim=1)

    def accumulate(self, kept, counted, queries):
        """Ages grow by the number of queries counted; a token used by query i of them is
        ``queries - i`` old (its newest use); tokens with no state yet were unused before them."""
        before = torch.zeros_like(counted)
        if kept is not None:
            before[..., : kept.shape[-1]] = kept
        return torch.where(counted > 0, counted - queries, before - queries)

    def check(self, budget, block_size, granularity):
        super().check(budget, block_size, granularity)
        if self.top_k < 1:
            raise ValueError(f"top_k must be a positive number of tokens, got {self.top_k}")

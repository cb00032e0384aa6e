"""H2O (Zhang et al., arXiv 2306.14048): heavy hitters plus recent tokens.

Every query adds the attention it pays to each cached token to that token's running total; the
cache keeps the ``recent`` newest tokens and, of the others, those with the largest totals (the
heavy hitters), per layer and KV head. H2O decides at every step; here the decision runs every
``block_size`` steps (the engine's eviction cadence), over totals that count every query. The
engine counts the window's queries whenever it holds nothing but uncounted ones, when the prompt
completes and at each eviction, whether or not the prompt was cut: what a query paid the cache is
exact when counted late (nothing was evicted in between, and the window is causal). The prompt is
counted from its last ``window`` queries (H2O proper sums all prompt queries: the full L x L
attention, which no paged engine keeps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from policies.attention import WindowScore, received_attention
from policies.base import blocks_above
from policies.registry import register_score


@register_score("h2o", granularity="token")
@dataclass
class H2O(WindowScore):
    """H2O: attention totals over every query (heavy hitters) plus the recent tokens, per KV head."""

    accumulates: ClassVar[bool] = True
    share: ClassVar[str] = "head"  # totals and choices per layer and KV head

    # window (WindowScore): queries kept per request and layer (every query is counted)
    recent: int | None = None  # newest tokens always kept; None: half the budget (H2O's even split)

    def __call__(self, keys, values, window=None):
        return received_attention(window, keys)

    def recent_tokens(self, budget: int) -> int:
        return budget // 2 if self.recent is None else self.recent

    def token_edges(self, budget, block_size):
        return 0, self.recent_tokens(budget)

    def min_budget(self, block_size, granularity):
        least = super().min_budget(block_size, granularity)
        return least if self.recent is None else max(least, blocks_above(self.recent, block_size))

    def check(self, budget, block_size, granularity):
        if not 0 <= self.recent_tokens(budget) < budget:
            raise ValueError(f"recent must be in [0, budget={budget}), got {self.recent}")
        super().check(budget, block_size, granularity)

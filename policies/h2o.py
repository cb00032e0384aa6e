"""H2O (Zhang et al., arXiv 2306.14048): heavy hitters plus recent tokens.

Every query adds the attention it pays to each cached token to that token's running total; the
cache keeps the ``recent`` newest tokens and, of the others, those with the largest totals (the
heavy hitters), per layer and KV head. H2O decides at every step; here the decision runs every
``block_size`` steps (the engine's eviction cadence), over totals that count every query: the
window (at least a block) holds the queries written since the last eviction, whose attention over
the cache is exactly what each of them paid (nothing was evicted in between, and the window is
causal). The prompt is counted from its last ``window`` queries (H2O proper sums all prompt
queries: the full L x L attention, which no paged engine keeps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from policies.attention import received_attention
from policies.base import TokenPolicy, keep_edges_and_best


@dataclass
class H2O(TokenPolicy):
    name: ClassVar[str] = "h2o"
    accumulates: ClassVar[bool] = True

    window: int = 32
    recent: int | None = None  # None: half the budget (H2O's even split of heavy and recent)
    per_head: bool = True      # totals and choices per layer and KV head

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent is None:
            self.recent = self.budget // 2
        if not 0 <= self.recent < self.budget:
            raise ValueError(f"recent must be in [0, budget={self.budget}), got {self.recent}")
        if self.window < self.block_size:
            raise ValueError(
                f"h2o counts every query, {self.block_size} between two evictions: window={self.window} "
                f"must be at least block_size={self.block_size}")
        if not self.per_head:
            raise ValueError("h2o keeps heavy hitters per layer and KV head (per_head=True)")

    @property
    def query_window(self) -> int:
        return self.window

    def layer_scores(self, keys, values, window=None):
        return received_attention(window, keys)

    def _keep(self, scores, layers, heads):
        return keep_edges_and_best(scores.expand(layers, heads, -1), 0, self.recent, self.budget)

    def select_decode(self, scores, tokens, layers, heads):
        return self._keep(scores, layers, heads)

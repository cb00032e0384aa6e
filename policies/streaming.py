"""StreamingLLM (Xiao et al. 2023): attention sinks plus a recent window.

The first ``n_sink`` tokens absorb attention mass the model needs to park somewhere; the rest of
the budget is the most recent tokens. With 4 sinks (the paper's default) decode eviction is
token-granular: every ``block_size`` steps the oldest non-sink tokens are compacted away.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from policies.base import TokenPolicy, blocks_above, broadcast_keep
from policies.registry import register_policy


@register_policy("streaming")
@dataclass
class StreamingLLM(TokenPolicy):
    """StreamingLLM: attention sinks plus the most recent tokens."""

    needs_kv: ClassVar[bool] = False  # positions alone decide

    n_sink: int = 4  # attention sinks: the first tokens, always kept

    def min_budget(self) -> int:
        return self.fit_prefix(blocks_above(self.n_sink, self.block_size))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.n_sink < self.budget:
            raise ValueError(f"n_sink must be in [0, budget={self.budget}), got {self.n_sink}")

    def _keep(self, tokens: int, layers: int, heads: int) -> torch.Tensor:
        sinks = self.first_kept(self.n_sink)  # the sinks, or the protected prefix
        recent = self.budget - sinks
        kept = torch.cat([torch.arange(sinks), torch.arange(tokens - recent, tokens)])
        return broadcast_keep(kept, layers, heads)

    def select_decode(self, scores, tokens, layers, heads):
        return self._keep(tokens, layers, heads)

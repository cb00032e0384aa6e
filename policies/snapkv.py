"""SnapKV (Li et al., arXiv 2404.14469): the prompt's last queries vote for the tokens to keep.

An observation window of the newest W queries sums the attention it pays to every earlier token,
per KV head (averaged over the query heads that share it); the votes are smoothed along the
sequence with a 1-D average pool (kernel 5, SnapKV's default), so a kept token keeps its
neighbours; each layer and KV head keeps the window plus its ``budget - W`` best-voted tokens.
SnapKV compresses the prompt only; here the same rule runs again at every decode eviction, with
the window being the newest W tokens then (``snapkv``, token granularity, compacting), or the
same score chooses whole blocks in decode (``snapkv_block``, PagedEviction's selection).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from policies.attention import Window, received_attention
from policies.base import ScoredBlockPolicy, TokenPolicy, keep_edges_and_best


def pooled_votes(window: Window, keys: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[kv_heads, tokens]`` window votes, average-pooled over the tokens before the window
    (zero-padded at both ends, as SnapKV pools); the window's own tokens keep their raw votes."""
    votes = received_attention(window, keys)
    before = votes.shape[-1] - len(window)
    pooled = F.avg_pool1d(votes[None, :, :before], kernel, stride=1, padding=kernel // 2)[0]
    return torch.cat([pooled, votes[:, before:]], dim=-1)


def check_window(window: int, kernel: int, budget: int) -> None:
    if not 0 < window < budget:
        raise ValueError(f"window must be in [1, budget={budget}), got {window}")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd number, got {kernel}")


@dataclass
class SnapKV(TokenPolicy):
    name: ClassVar[str] = "snapkv"

    window: int = 32
    kernel: int = 5
    per_head: bool = True  # SnapKV selects per layer and KV head

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.window, self.kernel, self.budget)
        if not self.per_head:
            raise ValueError("snapkv selects per layer and KV head (per_head=True)")

    @property
    def query_window(self) -> int:
        return self.window

    def layer_scores(self, keys, values, window=None):
        return pooled_votes(window, keys, self.kernel)

    def _keep(self, scores: torch.Tensor, layers: int, heads: int) -> torch.Tensor:
        return keep_edges_and_best(scores.expand(layers, heads, -1), 0, self.window, self.budget)

    def select_decode(self, scores, tokens, layers, heads):
        return self._keep(scores, layers, heads)


@dataclass
class SnapKVBlocks(ScoredBlockPolicy):
    """SnapKV's pooled votes at block granularity: prefill keeps the first block, the tail (which
    holds the window: ``window <= block_size``) and the best-voted tokens per KV head; decode drops
    the full block with the lowest mean vote."""

    name: ClassVar[str] = "snapkv_block"

    window: int = 32
    kernel: int = 5
    per_head: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.window, self.kernel, self.budget)
        if self.window > self.block_size:
            raise ValueError(
                f"snapkv_block keeps its window in the newest block: window={self.window} must be at most "
                f"block_size={self.block_size}")

    @property
    def query_window(self) -> int:
        return self.window

    def layer_scores(self, keys, values, window=None):
        return pooled_votes(window, keys, self.kernel)

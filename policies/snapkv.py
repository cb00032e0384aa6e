"""SnapKV (Li et al., arXiv 2404.14469): the prompt's last queries vote for the tokens to keep.

An observation window of the newest W queries sums the attention it pays to every earlier token,
per KV head (averaged over the query heads that share it); the votes are smoothed along the
sequence with a 1-D average pool (kernel 5, SnapKV's default), so a kept token keeps its
neighbours; each layer and KV head keeps the window plus its ``budget - W`` best-voted tokens.
SnapKV compresses the prompt only; here the same rule runs again at every decode eviction, with
the window being the newest W tokens then (``snapkv``, token granularity, compacting), or the
same score chooses whole blocks in decode (``snapkv_block``, PagedEviction's selection, which then
keeps the blocks that hold the window: one at 32-token blocks, two at the GPU's 16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from policies.attention import Window, WindowScore, received_attention
from policies.registry import register_score


def pooled_votes(window: Window, keys: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[kv_heads, tokens]`` window votes, average-pooled over the tokens before the window
    (zero-padded at both ends, as SnapKV pools); the window's own tokens keep their raw votes."""
    votes = received_attention(window, keys)
    before = votes.shape[-1] - len(window)
    pooled = F.avg_pool1d(votes[None, :, :before], kernel, stride=1, padding=kernel // 2)[0]
    return torch.cat([pooled, votes[:, before:]], dim=-1)


@register_score("snapkv", granularity="token", aliases={"snapkv_block": "block"})
@dataclass
class SnapKV(WindowScore):
    """SnapKV: the observation window's pooled attention votes, per KV head."""

    share: ClassVar[str] = "head"  # SnapKV selects per layer and KV head
    keeps_window: ClassVar[bool] = True  # the window's own tokens stay: window < budget

    # window (WindowScore): the observation window, the newest queries kept per request and layer
    kernel: int = 5  # average-pooling kernel over the votes

    def __call__(self, keys, values, window=None):
        return pooled_votes(window, keys, self.kernel)

    def token_edges(self, budget, block_size):
        return 0, self.window  # the window's own tokens stay

    def newest_kept(self) -> int:
        return self.window  # at block granularity: the blocks holding the window

    def min_budget(self, block_size, granularity):
        if granularity == "block":  # the blocks holding its window, and one more to evict
            return max(super().min_budget(block_size, granularity), (-(-self.window // block_size) + 1) * block_size)
        return super().min_budget(block_size, granularity)

    def check(self, budget, block_size, granularity):
        super().check(budget, block_size, granularity)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")
        window_blocks = -(-self.window // block_size)
        if granularity == "block" and budget // block_size < window_blocks + 1:
            raise ValueError(f"snapkv at block granularity keeps the {window_blocks} newest block(s) holding its "
                             f"window={self.window} and needs one more to evict: budget must be at least "
                             f"{(window_blocks + 1) * block_size}")

"""TOVA (Oren et al., arXiv 2401.06104): drop the tokens the newest query attends to least.

The score of a cached token is the attention the newest token's query pays it, averaged over all
query heads of the layer; each layer keeps its ``budget`` best tokens (one choice shared by the
layer's heads). TOVA evicts one token per generated token; here the decision runs every
``block_size`` steps (the engine's cadence) from the newest query then, so a token is judged by one
query instead of by each query of the block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from policies.attention import window_attention
from policies.registry import register_score
from policies.score import Score


@register_score("tova", granularity="token")
@dataclass
class TOVA(Score):
    """TOVA: the attention the newest query pays each token, per KV head (its query group
    averaged); the layer's heads share one choice from their average."""

    share: ClassVar[str] = "layer"  # one choice per layer, shared by its heads

    @property
    def query_window(self) -> int:
        return 1

    def __call__(self, keys, values, window=None):
        # [kv_heads, tokens]: each KV head's row averages its own query group; the selection
        # averages the rows (``share = "layer"``), which is the average over all query heads
        # (equal groups), and a head's row needs no other head's queries (tensor parallelism).
        return window_attention(window, keys)[:, :, -1].mean(dim=1)

    def token_edges(self, budget, block_size):
        return 0, 0

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
from policies.base import TokenPolicy, keep_edges_and_best


@dataclass
class TOVA(TokenPolicy):
    name: ClassVar[str] = "tova"

    @property
    def query_window(self) -> int:
        return 1

    def layer_scores(self, keys, values, window=None):
        newest = window_attention(window, keys)[:, :, -1].mean(dim=(0, 1))  # [tokens], all heads
        return newest.expand(keys.shape[1], -1)

    def _keep(self, scores, layers, heads):
        per_layer = keep_edges_and_best(scores[:, 0], 0, 0, self.budget)  # [layers, budget]
        return per_layer[:, None, :].expand(layers, heads, -1).contiguous()

    def select_decode(self, scores, tokens, layers, heads):
        return self._keep(scores, layers, heads)

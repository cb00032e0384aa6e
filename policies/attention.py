"""Attention from an observation window: what attention-aware policies score with.

vLLM's attention kernels return no attention weights, and no kernel is changed here. A policy
that needs attention declares a ``query_window`` W; the engine keeps, per request and layer, the
queries of the request's newest W tokens as the attention layer received them (post-RoPE), and
at eviction time the attention those queries pay to the cached keys is recomputed in PyTorch:
scaled dot products, causal within the window, softmax over the request's physical cache (the
tokens still cached, as the kernel saw them).

A score with a ``window`` option (SnapKV, H2O, LRU) is a ``WindowScore``: the option, its check and
the ``query_window`` it declares live there, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from policies.base import blocks_above
from policies.score import Score


@dataclass(frozen=True)
class Window:
    """One layer's window: ``queries`` ``[n, query_heads, head_dim]``, oldest first, of the
    request's newest n tokens, whose keys are the last n cached slots; ``scale`` is the layer's
    softmax scale (1/sqrt(head_dim) for Llama-style models)."""

    queries: torch.Tensor
    scale: float

    def __len__(self) -> int:
        return self.queries.shape[0]


def window_attention(window: Window, keys: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, group, n, tokens]`` attention probabilities of the window's queries over the
    cached ``[tokens, kv_heads, head_dim]`` keys, float32. Query heads are grouped by the KV head
    they read (query head h reads KV head h // group, vLLM's and Hugging Face's GQA layout)."""
    n, query_heads, dim = window.queries.shape
    tokens, kv_heads, _ = keys.shape
    if n > tokens:
        raise ValueError(f"a window of {n} queries over {tokens} cached tokens")
    group = query_heads // kv_heads
    # One [group * n, dim] x [dim, tokens] product per KV head (a broadcast matmul over the group
    # axis ran as group x kv_heads smaller products, 1.6x slower on CPU).
    queries = window.queries.float().reshape(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
    logits = torch.bmm(queries, keys.float().permute(1, 2, 0)).mul_(window.scale).view(kv_heads, group, n, tokens)
    # Query j of the window is the token in slot tokens - n + j: it saw the slots up to its own, so
    # only the window's own slots need the causal mask.
    offsets = torch.arange(n, device=keys.device)
    logits[..., tokens - n :].masked_fill_(offsets[None, :] > offsets[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def received_attention(window: Window, keys: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, tokens]``: the attention each cached token received from the window's queries,
    summed over the queries and averaged over the query heads that share its KV head."""
    return window_attention(window, keys).sum(dim=2).mean(dim=1)


@dataclass
class WindowScore(Score):
    """A score read from the attention that an observation window, the request's newest ``window``
    queries in each layer (its option), pays the cached keys: the engine keeps those queries for it
    and passes them as a ``Window``."""

    # The score's rule keeps the window's own tokens (SnapKV): the window must leave budget to choose.
    keeps_window: ClassVar[bool] = False

    window: int = 32  # queries kept per request and layer

    @property
    def query_window(self) -> int:
        return self.window

    def min_budget(self, block_size, granularity):
        return blocks_above(self.window, block_size) if self.keeps_window else 2 * block_size

    def check(self, budget, block_size, granularity):
        if self.keeps_window:
            if not 0 < self.window < budget:
                raise ValueError(f"window must be in [1, budget={budget}), got {self.window}")
        elif self.window < 1:
            raise ValueError(f"window must be a positive number of queries, got {self.window}")

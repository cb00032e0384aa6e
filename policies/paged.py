"""PagedEviction (Chitty-Venkata et al., arXiv 2509.04377): block-wise eviction scored by ||V||/||K||.

A token whose key has a small norm draws much attention, and a large value norm means a large
contribution when it does: ``||V|| / ||K||`` is an attention-free importance proxy. After prefill
the first block, the last ``B + L mod B`` tokens and the best ``C - 2B`` middle tokens survive; in
decode, each time the newest block fills past the budget, the lowest-scoring full block (never the
first, never the newest) leaves the block table whole, so nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from policies.base import BlockPolicy, broadcast_keep, comparable, keep_edges_and_best, l2

EPS = 1e-6


@dataclass
class PagedEviction(BlockPolicy):
    name: ClassVar[str] = "paged"

    # Which blocks may be evicted in decode: every full block but the first and the newest
    # ("global", the paper), or only the `local_blocks` oldest after the first (the fork's "local").
    candidates: Literal["global", "local"] = "global"
    local_blocks: int = 3
    # Layers whose scores are averaged: "all", or one layer index (the fork scored layer 0 only).
    score_layers: str | int = "all"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.candidates not in ("global", "local"):
            raise ValueError(f"candidates must be 'global' or 'local', got {self.candidates!r}")
        if self.score_layers != "all" and not isinstance(self.score_layers, int):
            raise ValueError(f"score_layers must be 'all' or a layer index, got {self.score_layers!r}")

    static_scores: ClassVar[bool] = True

    def scored_layers(self, num_layers: int) -> list[int]:
        return list(range(num_layers)) if self.score_layers == "all" else [self.score_layers]

    def layer_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[heads, tokens]`` scores ||V|| / max(||K||, eps)."""
        return (l2(values) / l2(keys).clamp_min(EPS)).T

    def cached_form(self, scores: torch.Tensor) -> torch.Tensor:
        # Decode decisions use the score averaged over layers and heads: one float per token.
        return scores.mean(dim=(0, 1), keepdim=True)

    def prefill_keep_count(self, prompt_len: int) -> int:
        if prompt_len <= self.budget:
            return prompt_len
        # C + (L mod B): the physical length stays congruent to the logical one modulo B.
        return self.budget + prompt_len % self.block_size

    def select_prefill(self, scores, tokens, layers, heads):
        tail = self.block_size + tokens % self.block_size
        total = self.prefill_keep_count(tokens)
        if self.per_head:
            return keep_edges_and_best(scores.expand(layers, -1, -1), self.block_size, tail, total)
        kept = keep_edges_and_best(scores.mean(dim=(0, 1)), self.block_size, tail, total)
        return broadcast_keep(kept, layers, heads)

    def select_victim(self, scores, tokens):
        blocks = tokens // self.block_size
        last_candidate = blocks - 2  # the newest block is blocks - 1
        if self.candidates == "local":
            last_candidate = min(last_candidate, self.local_blocks)
        if last_candidate < 1:
            raise ValueError(f"no evictable block among {blocks} (need at least 3 full blocks)")
        usable = blocks * self.block_size
        block_scores = scores.mean(dim=(0, 1))[:usable].view(blocks, self.block_size).mean(dim=-1)
        # argmin returns the first minimum: ties go to the oldest candidate, deterministically.
        return 1 + int(torch.argmin(comparable(block_scores[1 : last_candidate + 1])))

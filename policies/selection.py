"""Selection: what a policy does with any score, at token or at block granularity.

* Token granularity (``ScoredTokenPolicy``): after prefill and at each decode eviction the
  ``budget`` best-scored tokens stay, the first and last block protected (``protect_edges``) unless
  the score's rule names its own edges (SnapKV's window, H2O's recent tokens); the choice is per
  layer and KV head (``per_head``), or one per request from the scores averaged over layers and
  heads, or one per layer when the score says so (TOVA). Decode compacts the kept tokens.
* Block granularity (``ScoredBlockPolicy``, PagedEviction's rule): after prefill the first block,
  the last ``B + L mod B`` tokens and the best ``C - 2B`` middle tokens survive (``C + L mod B`` in
  all, so the physical length stays congruent to the logical one modulo B); in decode the full
  block with the lowest mean score, never the first nor the newest, leaves the block table whole:
  nothing is copied. With ``whole_blocks`` (the context compressed alone, ``compress=context``,
  which no decode eviction follows) the prefill keeps ``C`` exactly: the first block, the last
  ``B`` (the newest blocks a score keeps, SnapKV's window) and the best of the middle, so the kept
  context ends on a block boundary and a request sharing it copies no partial block. Prefill keep
  sets are per KV head or one per request: a score whose rule chooses per layer (TOVA) is averaged
  per request here.

A request's protected prefix (``Policy.protect_prefix``) stays at both granularities: it is the
first edge where it reaches past the rule's own (``first_kept``), and a block holding one of its
tokens is never a decode victim (``protected_blocks``); it counts inside the budget.

Both wrap a ``policies.score.Score``: what the engine must keep for it (static scores, a query
window, accumulated totals) is the score's to declare.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from policies.base import BlockPolicy, TokenPolicy, broadcast_keep, comparable, keep_edges_and_best
from policies.score import Score


class ScoredPolicy:
    """What a policy built on a score reads from it (mixed into both granularities)."""

    score: Score

    @property
    def static_scores(self) -> bool:
        return self.score.static

    @property
    def accumulates(self) -> bool:
        return self.score.accumulates

    @property
    def reconstructs(self) -> bool:
        return self.score.reconstructs

    @property
    def query_window(self) -> int:
        return self.score.query_window

    def layer_scores(self, keys, values, window=None):
        return self.score(keys, values, window)

    def min_budget(self) -> int:
        return self.fit_prefix(max(2 * self.block_size, self.score.min_budget(self.block_size, self.granularity)))

    def shares_per_head(self) -> bool:
        return self.score.share == "head" if self.score.share is not None else self.per_head


@dataclass
class ScoredTokenPolicy(ScoredPolicy, TokenPolicy):
    score: Score = None
    per_head: bool = True
    protect_edges: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.score.check(self.budget, self.block_size, self.granularity)

    def edges(self, budget: int) -> tuple[int, int]:
        """The (first, last) tokens the rule always keeps at ``budget``: the score's, or the first and
        last block (``protect_edges``)."""
        edges = self.score.token_edges(budget, self.block_size)
        if edges is None:
            edges = (self.block_size, self.block_size) if self.protect_edges else (0, 0)
        return edges

    def kept_beside_prefix(self, budget: int) -> int:
        return max(self.block_size, self.edges(budget)[1])

    def select_decode(self, scores, tokens, layers, heads):
        first, last = self.edges(self.budget)
        first = self.first_kept(first)  # the protected prefix stays
        if self.score.share == "layer":  # one choice per layer, from its heads' average
            per_layer = keep_edges_and_best(scores.mean(dim=1), first, last, self.budget)
            return per_layer[:, None, :].expand(layers, heads, -1).contiguous()
        if self.shares_per_head():
            return keep_edges_and_best(scores.expand(layers, heads, -1), first, last, self.budget)
        kept = keep_edges_and_best(scores.mean(dim=(0, 1)), first, last, self.budget)
        return broadcast_keep(kept, layers, heads)


@dataclass
class ScoredBlockPolicy(ScoredPolicy, BlockPolicy):
    score: Score = None
    # Prefill keep set: one per request (scores averaged over layers and heads) or per layer and head.
    per_head: bool = False
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
        self.score.check(self.budget, self.block_size, self.granularity)

    def scored_layers(self, num_layers: int) -> list[int]:
        return list(range(num_layers)) if self.score_layers == "all" else [self.score_layers]

    def cached_form(self, scores: torch.Tensor) -> torch.Tensor:
        # Decode decisions use the score averaged over layers and heads: one float per token.
        return scores.mean(dim=(0, 1), keepdim=True)

    def prefill_keep_count(self, prompt_len: int) -> int:
        if prompt_len <= self.budget:
            return prompt_len
        return self.budget + self.remainder(prompt_len)

    def remainder(self, tokens: int) -> int:
        """What the prefill eviction keeps beyond the budget: the prompt's partial last block, which
        keeps the physical length congruent to the logical one mod B (the authors' fork, whose decode
        evicts whole blocks as they fill); none with ``whole_blocks``. There no decode eviction
        follows (compress=context), so those tokens bought nothing but a partial last block, which
        every request taking the shared context must copy before writing its question."""
        return 0 if self.whole_blocks else tokens % self.block_size

    @property
    def newest_blocks(self) -> int:
        """The newest blocks that always stay: one, or those holding what the score's rule keeps."""
        return max(1, -(-self.score.newest_kept() // self.block_size))

    def kept_beside_prefix(self, budget: int) -> int:
        return self.newest_blocks * self.block_size  # and a decode eviction then has one block to drop

    def select_prefill(self, scores, tokens, layers, heads):
        first = self.first_kept(self.block_size)  # the first block, or the protected prefix
        tail = self.newest_blocks * self.block_size + self.remainder(tokens)
        total = self.prefill_keep_count(tokens)
        if self.shares_per_head():
            return keep_edges_and_best(scores.expand(layers, -1, -1), first, tail, total)
        kept = keep_edges_and_best(scores.mean(dim=(0, 1)), first, tail, total)
        return broadcast_keep(kept, layers, heads)

    def select_victim(self, scores, tokens):
        blocks = tokens // self.block_size
        # never the first block nor one holding a protected token, never the newest (blocks - 1)
        first_candidate = max(1, self.protected_blocks())
        last_candidate = blocks - 1 - self.newest_blocks
        if self.candidates == "local":  # the local_blocks oldest of those that may leave
            last_candidate = min(last_candidate, first_candidate + self.local_blocks - 1)
        if last_candidate < first_candidate:
            raise ValueError(f"no evictable block among {blocks} (need at least "
                             f"{first_candidate + self.newest_blocks + 1} full blocks)")
        usable = blocks * self.block_size
        block_scores = scores.mean(dim=(0, 1))[:usable].view(blocks, self.block_size).mean(dim=-1)
        # argmin returns the first minimum: ties go to the oldest candidate, deterministically.
        return first_candidate + int(torch.argmin(comparable(block_scores[first_candidate : last_candidate + 1])))

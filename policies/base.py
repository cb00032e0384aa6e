"""What every eviction policy is: a budget, a block size, a score and two decisions.

A policy never sees a block table or an engine. It answers three questions:

* how important is each cached token? ``layer_scores`` gets one layer's K/V of one request as
  ``[tokens, kv_heads, head_dim]`` tensors (keys post-RoPE, as cached) and returns
  ``[kv_heads, tokens]`` scores, higher = keep. The engine calls it one layer at a time (a whole
  request's K/V for every layer would be gigabytes on an 8B model), for the layers
  ``scored_layers`` names, and stacks the answers into ``[layers, heads, tokens]``;
* after prefill, when the prompt is longer than the budget: which prompt tokens survive
  (``select_prefill``, ``[layers, kv_heads, kept]`` sorted indices, equal counts everywhere);
* during decode, each time the cache holds ``budget + block_size`` tokens (the newest block just
  filled): a block policy names one block to drop (``select_victim``), a token policy says which
  ``budget`` tokens stay (``select_decode``).

A policy whose token scores never change once the token is written (``static_scores``, e.g.
||V||/||K|| or ||K||) lets the engine keep them per request (``cached_form``: a few floats per
token) and score only the tokens written since its last eviction. An attention-aware policy
declares a ``query_window`` W: its ``layer_scores`` also gets a ``Window`` (the queries of the
request's newest W tokens in that layer, ``policies.attention``); one whose scores add up over
the request's life (``accumulates``, H2O) gets only the queries no eviction has counted yet, and
the engine adds the result to the scores it keeps per request, which follow their tokens. ``prefill_keep``,
``decode_keep`` and ``decode_evict_block`` answer from whole ``[layers, tokens, heads, dim]``
tensors, for tests and notebooks. The engine owns when these are called; the policy owns what
they answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

Granularity = Literal["none", "block", "token"]


class BudgetError(ValueError):
    """A budget or block size that no engine can honour."""


def check_budget(budget: int, block_size: int) -> None:
    """Budgets are in tokens, at least two blocks (a sink block and a recent block) and aligned."""
    if not isinstance(block_size, int) or block_size < 1:
        raise BudgetError(f"block_size must be a positive integer, got {block_size!r}")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise BudgetError(f"budget must be an integer number of tokens, got {budget!r}")
    if budget < 2 * block_size:
        raise BudgetError(
            f"budget={budget} is below two blocks: it must be at least 2 x block_size = {2 * block_size}"
        )
    if budget % block_size:
        raise BudgetError(
            f"budget={budget} is not a multiple of block_size={block_size}: "
            f"use {budget - budget % block_size} or {budget - budget % block_size + block_size}"
        )


@dataclass
class Policy:
    """Base of every policy. ``budget`` is the number of cached tokens a request may keep."""

    budget: int
    block_size: int

    name: ClassVar[str] = ""
    granularity: ClassVar[Granularity] = "none"
    needs_kv: ClassVar[bool] = True        # False: decisions from positions alone (no scores)
    static_scores: ClassVar[bool] = False  # a token's score is fixed once its K/V is written
    accumulates: ClassVar[bool] = False    # scores are sums over the request's queries so far
    # True when a policy may keep different tokens per layer / KV head; the engine then compacts
    # each (layer, head) separately, which costs copies but no extra memory.
    per_head: bool = False

    def __post_init__(self) -> None:
        check_budget(self.budget, self.block_size)

    @property
    def evicts(self) -> bool:
        return self.granularity != "none"

    @property
    def query_window(self) -> int:
        """How many of a request's newest queries the engine must keep for this policy (0: none)."""
        return 0

    def prefill_keep_count(self, prompt_len: int) -> int:
        """How many prompt tokens stay after prefill; the engine sizes its copies from this."""
        return min(prompt_len, self.budget)

    def needs_prefill_eviction(self, prompt_len: int) -> bool:
        return self.evicts and prompt_len > self.budget

    def needs_decode_eviction(self, cached_tokens: int) -> bool:
        """Called after every step with the request's physical cache length."""
        return self.evicts and cached_tokens >= self.budget + self.block_size and (
            cached_tokens % self.block_size == 0
        )

    # --- scores --------------------------------------------------------------------------------
    def scored_layers(self, num_layers: int) -> list[int]:
        return list(range(num_layers))

    def layer_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[kv_heads, tokens]`` float32 scores of one layer's ``[tokens, kv_heads, dim]`` K/V."""
        raise NotImplementedError(f"{type(self).__name__} has no token score")

    def cached_form(self, scores: torch.Tensor) -> torch.Tensor:
        """What a static-score policy keeps per token between evictions (``[a, b, tokens]``, the
        selections below accept it in place of the full scores)."""
        return scores

    def scores_of(self, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> torch.Tensor | None:
        """``[scored layers, heads, tokens]`` from whole ``[layers, tokens, heads, dim]`` tensors
        (and, for an attention-aware policy, one ``Window`` per layer)."""
        if not self.needs_kv:
            return None
        layers = self.scored_layers(keys.shape[0])
        if self.query_window:
            return torch.stack([self.layer_scores(keys[l], values[l], windows[l]) for l in layers])
        return torch.stack([self.layer_scores(keys[l], values[l]) for l in layers])

    # --- decisions -----------------------------------------------------------------------------
    def select_prefill(self, scores: torch.Tensor | None, tokens: int, layers: int, heads: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not evict in prefill")

    def prefill_keep(self, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> torch.Tensor:
        layers, tokens, heads, _ = keys.shape
        return self.select_prefill(self.scores_of(keys, values, windows), tokens, layers, heads)

    def describe(self) -> dict:
        """What a results table needs to know about how this policy spends memory and copies."""
        return {
            "policy": self.name,
            "budget": self.budget,
            "block_size": self.block_size,
            "granularity": self.granularity,
            "per_head": self.per_head,
            "decode_copies": self.granularity == "token",
        }


class BlockPolicy(Policy):
    """Evicts whole blocks in decode: the victim leaves the block table, nothing is copied."""

    granularity: ClassVar[Granularity] = "block"

    def select_victim(self, scores: torch.Tensor | None, tokens: int) -> int:
        """Position, in the request's block list, of the block to drop."""
        raise NotImplementedError

    def decode_evict_block(self, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> int:
        return self.select_victim(self.scores_of(keys, values, windows), keys.shape[1])


class TokenPolicy(Policy):
    """Evicts single tokens in decode: the engine compacts ``budget + block_size`` back to budget."""

    granularity: ClassVar[Granularity] = "token"

    def select_decode(self, scores: torch.Tensor | None, tokens: int, layers: int, heads: int) -> torch.Tensor:
        raise NotImplementedError

    def select_prefill(self, scores, tokens, layers, heads):
        # A token policy keeps by the same rule after prefill as in decode unless it says otherwise.
        return self.select_decode(scores, tokens, layers, heads)

    def decode_keep(self, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> torch.Tensor:
        layers, tokens, heads, _ = keys.shape
        return self.select_decode(self.scores_of(keys, values, windows), tokens, layers, heads)


def broadcast_keep(kept: torch.Tensor, layers: int, heads: int) -> torch.Tensor:
    """A keep set shared by every layer and head, in the ``[layers, heads, kept]`` shape."""
    return kept.sort().values.view(1, 1, -1).expand(layers, heads, -1).contiguous()


SCORE_BITS = 11  # significant bits kept when ranking scores (float16's precision)


def comparable(scores: torch.Tensor) -> torch.Tensor:
    """Scores rounded to ``SCORE_BITS`` significant bits before they are ranked.

    Two engines compute the same K/V up to float rounding (different kernels, summation order).
    Scores closer than one part in 2^11 are treated as a tie, which goes to the earlier token, so
    a last-bit difference cannot flip a decision the policy considers a tie anyway.
    """
    mantissa, exponent = torch.frexp(scores.float())
    return torch.ldexp(torch.round(mantissa * 2**SCORE_BITS) / 2**SCORE_BITS, exponent)


def top_tokens(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest scores along the last axis, ascending positions.

    Ties (scores equal at ``SCORE_BITS`` precision) go to the earlier token: a stable sort makes
    the choice deterministic on every backend.
    """
    order = torch.sort(-comparable(scores), dim=-1, stable=True).indices
    return order[..., :count].sort(dim=-1).values


def keep_edges_and_best(
    scores: torch.Tensor, protect_first: int, protect_last: int, total: int
) -> torch.Tensor:
    """Keep the first and last tokens unconditionally, fill the rest of ``total`` by score.

    ``scores`` is ``[..., tokens]`` (higher = more important); the result is ``[..., total]``
    sorted token indices. The protected ranges never overlap the middle the scores choose from.
    """
    tokens = scores.shape[-1]
    middle = total - protect_first - protect_last
    if middle < 0 or protect_first + protect_last > tokens or total > tokens:
        raise ValueError(
            f"cannot keep {total} of {tokens} tokens with {protect_first} first and "
            f"{protect_last} last protected"
        )
    lead = scores.shape[:-1]
    first = torch.arange(protect_first, device=scores.device).expand(*lead, -1)
    last = torch.arange(tokens - protect_last, tokens, device=scores.device).expand(*lead, -1)
    best = top_tokens(scores[..., protect_first : tokens - protect_last], middle) + protect_first
    return torch.cat([first, best, last], dim=-1)


def l2(x: torch.Tensor) -> torch.Tensor:
    """Per-token L2 norm over head_dim, in float32 whatever the cache dtype."""
    return torch.linalg.vector_norm(x.float(), dim=-1)


@dataclass
class ScoredTokenPolicy(TokenPolicy):
    """A token policy that keeps the ``budget`` best-scored tokens, the edges protected.

    Subclasses only define ``layer_scores``. Selection is per layer and KV head by default
    (``per_head=False`` averages the scores into one shared choice).
    """

    per_head: bool = True
    protect_edges: bool = True

    def _keep(self, scores: torch.Tensor, layers: int, heads: int) -> torch.Tensor:
        edge = self.block_size if self.protect_edges else 0
        if self.per_head:
            return keep_edges_and_best(scores.expand(layers, heads, -1), edge, edge, self.budget)
        kept = keep_edges_and_best(scores.mean(dim=(0, 1)), edge, edge, self.budget)
        return broadcast_keep(kept, layers, heads)

    def select_decode(self, scores, tokens, layers, heads):
        return self._keep(scores, layers, heads)


@dataclass
class ScoredBlockPolicy(BlockPolicy):
    """Any token score, block-wise (PagedEviction's shape): after prefill the first block, the last
    ``B + L mod B`` tokens and the best ``C - 2B`` middle tokens survive (``C + L mod B`` in all, so
    the physical length stays congruent to the logical one modulo B); in decode the full block with
    the lowest mean score, never the first nor the newest, leaves the block table whole.

    Subclasses only define ``layer_scores``. Scores are averaged over the scored layers and KV heads
    into one keep set per request (``per_head=True`` selects prefill tokens per layer and head).
    """

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

    def scored_layers(self, num_layers: int) -> list[int]:
        return list(range(num_layers)) if self.score_layers == "all" else [self.score_layers]

    def cached_form(self, scores: torch.Tensor) -> torch.Tensor:
        # Decode decisions use the score averaged over layers and heads: one float per token.
        return scores.mean(dim=(0, 1), keepdim=True)

    def prefill_keep_count(self, prompt_len: int) -> int:
        if prompt_len <= self.budget:
            return prompt_len
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

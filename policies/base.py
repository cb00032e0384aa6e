"""What every eviction policy is: a budget, a block size and the decisions the engine asks for.

A policy never sees a block table or an engine. It answers three questions:

* how important is each cached token? ``layer_scores`` gets one layer's K/V of one request as
  ``[tokens, kv_heads, head_dim]`` tensors and returns ``[kv_heads, tokens]`` scores (a scored
  policy asks its ``policies.score.Score``). The engine calls it one layer at a time, for the
  layers ``scored_layers`` names, and stacks the answers into ``[layers, heads, tokens]``;
* after prefill, when the prompt is longer than the budget: which prompt tokens survive
  (``select_prefill``, ``[layers, kv_heads, kept]`` sorted indices, equal counts everywhere);
* during decode, each time the cache holds ``budget + block_size`` tokens (the newest block just
  filled): a block policy names one block to drop (``select_victim``), a token policy says which
  ``budget`` tokens stay (``select_decode``).

What the score needs (``static_scores``, ``query_window``, ``accumulates``) tells the engine what
to keep per request (``policies.score``). Scored policies, one score at either granularity, are in
``policies.selection``. The engine owns when these are called; the policy owns what they answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

Granularity = Literal["none", "block", "token"]


class BudgetError(ValueError):
    """A budget or block size that no engine can honour."""


def blocks_above(tokens: int, block_size: int) -> int:
    """The smallest whole-block budget that holds more than ``tokens`` (and at least two blocks)."""
    return max(2, tokens // block_size + 1) * block_size


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
    # False: evict the prompt only (after prefill), never while generating (kvpress's presses).
    decode_eviction: bool = field(default=True, kw_only=True)
    # True: the prefill eviction keeps exactly the budget, whole blocks, at any granularity (a block
    # rule otherwise keeps L mod B more: ``ScoredBlockPolicy``). A run setting, like decode_eviction:
    # ``harness.eviction.settings.build_policy`` sets it where the context is compressed alone
    # (compress=context), which no decode eviction follows and whose kept blocks other requests share.
    whole_blocks: bool = field(default=False, kw_only=True)
    # The request's first N tokens, never evicted by any selection (a system prompt it must keep): a
    # run setting too (``EvictionSettings.protect_prefix``). They count inside the budget. Kept from
    # the first eviction on, they stay in the request's first N slots (a compaction keeps its tokens
    # in order, a dropped block leaves the slots before it), so a selection keeps its first N slots
    # (``first_kept``) and a block selection never drops a block holding one (``protected_blocks``);
    # ``check_carried`` refuses a prefix that leaves the rule no room beside it.
    protect_prefix: int = field(default=0, kw_only=True)

    name: ClassVar[str] = ""
    granularity: ClassVar[Granularity] = "none"
    needs_kv: ClassVar[bool] = True        # False: decisions from positions alone (no scores)
    static_scores: ClassVar[bool] = False  # a token's score is fixed once its K/V is written
    accumulates: ClassVar[bool] = False    # scores are sums over the request's queries so far
    reconstructs: ClassVar[bool] = False   # scores left by reconstruction passes (KVzip), not from K/V

    def __post_init__(self) -> None:
        check_budget(self.budget, self.block_size)

    @property
    def evicts(self) -> bool:
        return self.granularity != "none"

    @property
    def query_window(self) -> int:
        """How many of a request's newest queries the engine must keep for this policy (0: none)."""
        return 0

    def min_budget(self) -> int:
        """The smallest budget, in tokens (whole blocks, at least two), at which this policy with
        its options (and its protected prefix: ``fit_prefix``) is valid: what a ratio's budget on a
        short prompt, or a layer group's share, is raised to. A policy whose options need more says
        so here, beside its check."""
        return self.fit_prefix(2 * self.block_size)

    # --- the protected prefix (``protect_prefix``): every selection below honours it -------------
    def first_kept(self, first: int = 0) -> int:
        """The first slots a selection keeps: its rule's own (``first``: a block of sinks, StreamingLLM's
        sinks) or the protected prefix, the longer."""
        return max(first, self.protect_prefix)

    def protected_blocks(self) -> int:
        """The leading blocks holding a protected token: a block selection never drops one."""
        return -(-self.protect_prefix // self.block_size)

    def prefix_span(self) -> int:
        """What the protected prefix takes of the budget: its tokens (a block policy: the whole
        blocks holding them, which are never dropped)."""
        return self.protect_prefix

    def kept_beside_prefix(self, budget: int) -> int:
        """The fewest tokens the rule must keep beside the protected prefix at ``budget``: at least a
        block of its own choice (a rule that always keeps its newest tokens says how many)."""
        return self.block_size

    def fits_prefix(self, budget: int) -> bool:
        return not self.protect_prefix or self.prefix_span() + self.kept_beside_prefix(budget) <= budget

    def fit_prefix(self, budget: int) -> int:
        """``budget``, raised by whole blocks until the protected prefix fits beside what the rule keeps."""
        while not self.fits_prefix(budget):
            budget += self.block_size
        return budget

    def check_carried(self) -> None:
        """The run settings the policy carries (set once it is built: ``harness.eviction.admission.
        build_policy``) against its budget: a protected prefix must leave the rule room to choose."""
        prefix = self.protect_prefix
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise ValueError(f"protect_prefix must be a number of tokens >= 0, got {prefix!r}")
        if not self.evicts or self.fits_prefix(self.budget):
            return
        span, beside = self.prefix_span(), self.kept_beside_prefix(self.budget)
        held = f"the {span // self.block_size} block(s) holding it" if span != prefix else "it"
        raise BudgetError(
            f"protect_prefix={prefix} leaves {self.budget - span} of budget={self.budget} tokens beside {held}; "
            f"{self.name or type(self).__name__} needs {beside} there (at least a block, and the newest tokens its "
            f"rule keeps): raise the budget to {self.fit_prefix(self.budget)} or protect fewer tokens")

    def prefill_keep_count(self, prompt_len: int) -> int:
        """How many prompt tokens stay after prefill; the engine sizes its copies from this."""
        return min(prompt_len, self.budget)

    def needs_prefill_eviction(self, prompt_len: int) -> bool:
        return self.evicts and prompt_len > self.budget

    def needs_decode_eviction(self, cached_tokens: int) -> bool:
        """Called after every step with the request's physical cache length."""
        return self.evicts and self.decode_eviction and cached_tokens >= self.budget + self.block_size and (
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

    # --- decisions -----------------------------------------------------------------------------
    def select_prefill(self, scores: torch.Tensor | None, tokens: int, layers: int, heads: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not evict in prefill")


class BlockPolicy(Policy):
    """Evicts whole blocks in decode: the victim leaves the block table, nothing is copied."""

    granularity: ClassVar[Granularity] = "block"

    def prefix_span(self) -> int:
        return self.protected_blocks() * self.block_size

    def select_victim(self, scores: torch.Tensor | None, tokens: int) -> int:
        """Position, in the request's block list, of the block to drop."""
        raise NotImplementedError


class TokenPolicy(Policy):
    """Evicts single tokens in decode: the engine compacts ``budget + block_size`` back to budget."""

    granularity: ClassVar[Granularity] = "token"

    def select_decode(self, scores: torch.Tensor | None, tokens: int, layers: int, heads: int) -> torch.Tensor:
        raise NotImplementedError

    def select_prefill(self, scores, tokens, layers, heads):
        # A token policy keeps by the same rule after prefill as in decode unless it says otherwise.
        return self.select_decode(scores, tokens, layers, heads)


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

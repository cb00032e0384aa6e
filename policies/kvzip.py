"""KVzip (Kim et al., NeurIPS 2025, arXiv 2505.23416): keep what the model reads to repeat the context.

Query-agnostic: once the prefill reaches the eviction point c (the context's end under
``compress=context``, the prompt's end otherwise), the model is asked to repeat the context from
its cache. For each chunk of the context after its chat header (``prefix`` tokens), one pass runs
over the cache with the input ``first + suffix + chunk`` (the first chunk) or ``later + the previous
chunk's last `postfix` ids + suffix + chunk``, at positions c.. (each pass starts again at c: its own
K/V is dropped once it is scored, and the question later runs at c.. as if no pass had run). A
context token's score is the largest attention any of the pass's queries pays it, per KV head (the
largest over the query heads reading that head too), in a softmax over the context's first
``min(n_sink, start)`` tokens, the chunk's own tokens and the pass's own tokens (causal among
them): kvpress 0.5.5's ``KVzipPress`` computes exactly that denominator, which is not the
model's own (the model's attention in the pass reads the whole cache). Header tokens after the sinks
are never repeated and score 0; the first ``n_sink`` tokens are always kept.

The harness keeps equal counts per (layer, KV head), the authors' ``pair-uniform`` level: a paged
engine has one slot per token for every KV head of a layer, and its kernels take one length per
request (``docs/design_kvzip.md`` §5.2). kvpress's default chooses one global threshold over layers
and heads instead; across layer groups that allocation is the ``kvzip`` budget schedule
(``policies.budget_schedules.kvzip_layer_counts``, ``budget_schedule=kvzip``), the heads of a layer
still equal.

This module is pure PyTorch: the score (``chunk_scores``), how a context splits into passes
(``passes``) and the sinks' rule (``with_sinks``). Running the passes is the engine's
(``harness.engine.reconstruction``) or a reference's: the score is declared ``reconstructs``, so the
evictor reads what the passes left in the request's state instead of scoring K/V itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from policies.registry import register_score
from policies.score import Score

TILE = 256  # queries per softmax tile: bounds a layer's logits to [kv_heads, group * TILE, keys]


def chunk_scores(queries: torch.Tensor, sink_keys: torch.Tensor, chunk_keys: torch.Tensor, own_keys: torch.Tensor,
                 scale: float, tile: int = TILE) -> torch.Tensor:
    """``[kv_heads, chunk]`` float32: for each token of a chunk, the largest attention it gets
    from ``queries`` ``[n, query_heads, dim]`` (post-RoPE), per KV head over its query group too.

    Each query's softmax runs over ``sink_keys`` ``[s, kv_heads, dim]``, ``chunk_keys`` ``[chunk,
    kv_heads, dim]`` and the pass's ``own_keys`` ``[m, kv_heads, dim]`` up to its own: the queries
    are the pass's last n tokens (m >= n; a pass run in pieces gives every piece its earlier
    pieces' keys), so query j reads own keys ``0 .. m - n + j``. The maximum over queries is taken
    ``tile`` queries at a time: each softmax row is whole within a tile, so tiles combine exactly."""
    n, m = queries.shape[0], own_keys.shape[0]
    if n > m:
        raise ValueError(f"{n} queries but only {m} own keys: the queries are the pass's newest tokens")
    chunk = chunk_keys.shape[0]
    lead = sink_keys.shape[0]
    best = torch.zeros(own_keys.shape[1], chunk, device=queries.device)
    for _, _, probabilities in causal_tiles(queries, torch.cat([sink_keys, chunk_keys]), own_keys, scale, tile):
        received = probabilities[..., lead:lead + chunk]  # [kv_heads, group, rows, chunk]
        best = torch.maximum(best, received.amax(dim=(1, 2)))
    return best


def causal_tiles(queries: torch.Tensor, earlier_keys: torch.Tensor, own_keys: torch.Tensor, scale: float,
                 tile: int = TILE, window: int | None = None):
    """The softmax of a pass's newest n queries ``[n, query_heads, dim]`` over ``earlier_keys``
    ``[e, kv_heads, dim]`` (all visible) and the pass's ``own_keys`` ``[m, kv_heads, dim]`` (m >= n,
    causal: query j reads own keys ``0 .. m - n + j``), in float32, ``tile`` queries at a time:
    yields ``(first, last, probabilities [kv_heads, group, last - first, e + m])``. Query head h
    reads KV head h // group (vLLM's and Hugging Face's GQA layout). The one tiled causal attention
    of KVzip's passes: its scores (``chunk_scores``) and the engine's pass outputs
    (``harness.engine.reconstruction.pass_attention``).

    ``window``: a sliding-window layer's (a hybrid model's local layers, which the passes run
    through but never score): the earlier keys are then the positions just before the pass's own,
    and a query reads only keys fewer than ``window`` positions behind it, its own included."""
    n, query_heads, dim = queries.shape
    m, kv_heads, _ = own_keys.shape
    group = query_heads // kv_heads
    keys = torch.cat([earlier_keys, own_keys]).float().permute(1, 2, 0)  # [kv_heads, dim, keys]
    lead = earlier_keys.shape[0]
    own = torch.arange(m, device=queries.device)
    for first in range(0, n, tile):
        last = min(first + tile, n)
        rows = last - first
        q = queries[first:last].float().reshape(rows, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(
            kv_heads, group * rows, dim)
        logits = torch.bmm(q, keys).mul_(scale).view(kv_heads, group, rows, -1)
        # Own key i is hidden from query j (the pass's token m - n + first + j) when i > m - n + first + j.
        sees = m - n + torch.arange(first, last, device=queries.device)
        logits[..., lead:].masked_fill_(own[None, :] > sees[:, None], float("-inf"))
        if window is not None:  # key at own index i (earlier keys: -e .. -1) is too far behind query j
            behind = sees[:, None] - torch.arange(-lead, m, device=queries.device)[None, :]
            logits.masked_fill_(behind >= window, float("-inf"))
        yield first, last, torch.softmax(logits, dim=-1)


def chunk_spans(context: int, prefix: int, chunk_size: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` context positions each pass repeats: the context after its header, in
    ``chunk_size`` pieces (kvpress chunks the context's ids after the prefix the same way)."""
    return [(start, min(start + chunk_size, context)) for start in range(prefix, context, chunk_size)]


def passes(context: Sequence[int], prefix: int, first: Sequence[int], later: Sequence[int], suffix: Sequence[int],
           chunk_size: int, postfix: int) -> list[tuple[list[int], int, int]]:
    """Each reconstruction pass's input ids and the chunk ``[start, end)`` it repeats: the first
    chunk after ``first + suffix``, every later one after ``later``, the previous chunk's last
    ``postfix`` ids (all of it if shorter) and ``suffix`` (kvpress's ``prepare``)."""
    out = []
    for start, end in chunk_spans(len(context), prefix, chunk_size):
        if start == prefix:
            lead = list(first)
        else:
            lead = list(later) + list(context[max(start - postfix, start - chunk_size):start])
        out.append((lead + list(suffix) + list(context[start:end]), start, end))
    return out


def with_sinks(scores: torch.Tensor, n_sink: int, above: float | None = None) -> torch.Tensor:
    """The request's ``[layers, kv_heads, context]`` scores with its first ``n_sink`` tokens above
    every other (kvpress's ``amax + 1``; ``above``: the maximum over more than these scores, every
    layer group's): they stay whatever the budget. In place; returned."""
    if n_sink:
        scores[..., :n_sink] = (float(scores.max()) if above is None else above) + 1
    return scores


@register_score("kvzip", granularity="token")
@dataclass
class KVzip(Score):
    """KVzip: the largest attention a token gets while the model repeats the context, per KV head."""

    share: ClassVar[str] = "head"    # KVzip's scores are per layer and KV head, chosen per head
    reconstructs: ClassVar[bool] = True  # scores come from reconstruction passes, not from K/V

    n_sink: int = 4          # the context's first tokens: always kept, always in the softmax (kvpress)
    chunk_size: int = 2048   # context tokens one pass repeats (kvpress 0.5.5's default)
    postfix: int = 8         # ids of the previous chunk a later chunk's repeat prompt ends with

    @property
    def reads_values(self) -> bool:
        return False  # nothing read at eviction: the passes already scored

    def __call__(self, keys, values, window=None):
        raise RuntimeError("kvzip scores from its reconstruction passes, which the engine runs before the "
                           "eviction; no score is computed from K/V alone")

    def token_edges(self, budget, block_size):
        return self.n_sink, 0  # the sinks stay; no recent window (kvpress has none)

    def check(self, budget, block_size, granularity):
        for name in ("n_sink", "chunk_size", "postfix"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 0 <= self.n_sink < budget:
            raise ValueError(f"n_sink must be in [0, budget={budget}), got {self.n_sink}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {self.chunk_size}")
        if self.postfix < 0:
            raise ValueError(f"postfix must be a number of ids >= 0, got {self.postfix}")

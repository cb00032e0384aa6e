"""Per-request policy state between evictions, kept by the worker (and the Hugging Face reference).

What a request's policy remembers between evictions: the scores a static-score policy cached or an
accumulating one summed (in slot order), and the query windows of attention-aware policies with
each layer's softmax scale. It is dropped when the request lets go of its blocks (finish, abort,
preemption: a replay rebuilds it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from policies.attention import Window


class QueryWindow:
    """A request's newest queries (at most ``size``), ``[layers, n, query_heads, head_dim]`` oldest
    first, and how many of the newest an accumulating policy has not counted yet (``fresh``).

    Held in a ring of ``size`` slots allocated once: a decode step writes its one query per layer
    in place (copying the whole window every step cost about 3% of a step at SmolLM2's shape);
    ``queries`` puts them in order when an eviction reads them."""

    def __init__(self, first: torch.Tensor, size: int):
        layers, _, heads, dim = first.shape
        self.ring = first.new_empty(layers, size, heads, dim)
        self.filled = self.next = self.fresh = 0
        self.add(first)

    def add(self, queries: torch.Tensor) -> None:
        size, count = self.ring.shape[1], queries.shape[1]
        if count >= size:
            self.ring.copy_(queries[:, count - size:])
            self.next = 0
        else:
            first = min(count, size - self.next)
            self.ring[:, self.next : self.next + first] = queries[:, :first]
            self.ring[:, : count - first] = queries[:, first:]
            self.next = (self.next + count) % size
        self.filled = min(self.filled + count, size)
        self.fresh = min(self.fresh + count, size)

    @property
    def queries(self) -> torch.Tensor:
        if self.filled < self.ring.shape[1]:
            return self.ring[:, : self.filled]
        if self.next == 0:
            return self.ring
        return torch.cat([self.ring[:, self.next :], self.ring[:, : self.next]], dim=1)

    @property
    def nbytes(self) -> int:
        return self.ring.numel() * self.ring.element_size()


class MissingWindowError(RuntimeError):
    """An attention-aware policy must evict, but the engine captured no queries for the request."""


@dataclass
class PolicyState:
    """Every live request's policy state, by request id: ``scores`` (``policy.cached_form`` of the
    cached or summed scores, in slot order), ``windows`` (query windows), and each layer's softmax
    ``scales`` (one per model)."""

    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    windows: dict[str, QueryWindow] = field(default_factory=dict)
    scales: list[float] = field(default_factory=list)

    def observe(self, request_id: str, queries: torch.Tensor, size: int) -> None:
        """Add the ``[layers, k, heads, dim]`` queries a step computed; keep the newest ``size``."""
        window = self.windows.get(request_id)
        if window is None:
            self.windows[request_id] = QueryWindow(queries, size)
        else:
            window.add(queries)

    def layer_windows(self, request_id: str, fresh_only: bool) -> list[Window]:
        window = self.windows.get(request_id)
        if window is None or not window.filled:
            raise MissingWindowError(f"request {request_id} must evict by attention but no queries were captured for it")
        queries = window.queries
        count = window.fresh if fresh_only else window.filled
        return [Window(layer[window.filled - count:], scale) for layer, scale in zip(queries, self.scales)]

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.scores.pop(request_id, None)
            self.windows.pop(request_id, None)

    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.scores.values())
                + sum(window.nbytes for window in self.windows.values()))

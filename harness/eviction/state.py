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


@dataclass
class QueryWindow:
    """A request's newest queries, ``[layers, n, query_heads, head_dim]`` oldest first, and how many
    of the newest an accumulating policy has not counted yet (``fresh``)."""

    queries: torch.Tensor
    fresh: int = 0


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
        uncounted = queries.shape[1]
        if window is not None:
            queries = torch.cat([window.queries, queries], dim=1)
            uncounted += window.fresh
        self.windows[request_id] = QueryWindow(queries[:, -size:], min(uncounted, size))

    def layer_windows(self, request_id: str, fresh_only: bool) -> list[Window]:
        window = self.windows.get(request_id)
        if window is None or not window.queries.shape[1]:
            raise MissingWindowError(f"request {request_id} must evict by attention but no queries were captured for it")
        count = window.fresh if fresh_only else window.queries.shape[1]
        return [Window(layer[window.queries.shape[1] - count:], scale) for layer, scale in zip(window.queries, self.scales)]

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.scores.pop(request_id, None)
            self.windows.pop(request_id, None)

    def nbytes(self) -> int:
        tensors = list(self.scores.values()) + [w.queries for w in self.windows.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

"""Hybrid: a weighted sum of registered scores, each min-max normalised per layer and KV head.

``weights`` names any registered scores (at their default options) and how much each counts, for
example attention (SnapKV's votes), recency and KeyDiff, the default. Each component's scores are
scaled to [0, 1] over the request's tokens (a constant row scores 0) before they are weighed, so
no score dominates by its units. Components that accumulate state over the request (H2O, LRU)
are refused: their totals would need per-request state of their own. Attention-aware components share one
query window, the longest any of them needs. Every component is taken per KV head (TOVA's too: the
newest query's attention averaged over that head's query group), so the sum is per head as well.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from policies.attention import Window
from policies.registry import REGISTRY, register_score
from policies.score import Score


def normalised(scores: torch.Tensor) -> torch.Tensor:
    """Each row of ``[heads, tokens]`` scaled to [0, 1]; a constant row becomes 0."""
    low = scores.amin(dim=-1, keepdim=True)
    span = scores.amax(dim=-1, keepdim=True) - low
    return torch.where(span > 0, (scores - low) / span.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


@register_score("hybrid", granularity="token")
@dataclass
class Hybrid(Score):
    """Hybrid: a weighted sum of normalised registered scores (attention, recency and KeyDiff by default)."""

    weights: dict = field(default_factory=lambda: {"snapkv": 1.0, "recency": 1.0, "keydiff": 1.0})

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("hybrid needs at least one score in weights")
        self.components: dict[str, Score] = {}
        for name, weight in self.weights.items():
            entry = REGISTRY.get(name)
            if entry is None or entry.score is None or entry.alias_of or name == "hybrid":
                scores = sorted(n for n, e in REGISTRY.items() if e.score and not e.alias_of and n != "hybrid")
                raise ValueError(f"hybrid weights name {name!r}, which is not a score; valid: {', '.join(scores)}")
            if entry.score.accumulates:
                raise ValueError(f"hybrid cannot combine {name!r}: its state accumulates over the request")
            if entry.score.reconstructs:
                raise ValueError(f"hybrid cannot combine {name!r}: its scores come from reconstruction passes the "
                                 "engine runs for it alone, not from the K/V a hybrid scores")
            if not isinstance(weight, (int, float)) or isinstance(weight, bool):
                raise ValueError(f"hybrid weight of {name!r} must be a number, got {weight!r}")
            self.components[name] = entry.score()

    @property
    def query_window(self) -> int:
        return max(component.query_window for component in self.components.values())

    @property
    def reads_values(self) -> bool:
        return any(component.reads_values for component in self.components.values())

    def __call__(self, keys, values, window=None):
        total = torch.zeros(keys.shape[1], keys.shape[0], device=keys.device)
        for name, component in self.components.items():
            own = None
            if component.query_window:
                own = Window(window.queries[len(window) - component.query_window:], window.scale)
            total += float(self.weights[name]) * normalised(component(keys, values, own))
        return total

    def min_budget(self, block_size, granularity):
        return max(component.min_budget(block_size, granularity) for component in self.components.values())

    def check(self, budget, block_size, granularity):
        for component in self.components.values():
            component.check(budget, block_size, granularity)

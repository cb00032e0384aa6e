"""Full cache: nothing is evicted; the patched engine must behave exactly like stock vLLM."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from policies.base import Granularity, Policy
from policies.registry import register_policy


@register_policy("full")
@dataclass
class FullCache(Policy):
    """Full cache: every token kept (stock vLLM)."""

    granularity: ClassVar[Granularity] = "none"

    def __post_init__(self) -> None:
        pass  # the budget does not apply: every token stays

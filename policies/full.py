"""Full cache: nothing is evicted; the patched engine must behave exactly like stock vLLM."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from policies.base import Granularity, Policy


@dataclass
class FullCache(Policy):
    name: ClassVar[str] = "full"
    granularity: ClassVar[Granularity] = "none"

    def __post_init__(self) -> None:
        pass  # the budget does not apply: every token stays

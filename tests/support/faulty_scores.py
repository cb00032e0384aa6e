"""Scores written the way the README invites a user to write one, each wrong in its own way: what
the engine must contain to the requests that use them. Loaded only where a test names this module
in ``KVH_POLICY_MODULES`` (``policies/__init__.py``)."""
from __future__ import annotations

import torch

from policies.base import l2
from policies.registry import register_score

# Longer than the admission's try (two blocks of 32), shorter than the tests' prompts.
LATE = 100


@register_score("faulty_raises", granularity="block")
def faulty_raises(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Raises on any input (caught at admission)."""
    raise RuntimeError("this score is broken")


@register_score("faulty_shape", granularity="block")
def faulty_shape(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One score per token instead of one per head and token (caught at admission)."""
    return l2(values).sum(-1)


@register_score("faulty_late", granularity="block")
def faulty_late(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Fine on short inputs, raises on long ones: passes admission, fails in the engine."""
    if keys.shape[0] > LATE:
        raise ZeroDivisionError("a bug that only long prompts reach")
    return l2(values).T


@register_score("faulty_nan", granularity="token")
def faulty_nan(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Fine on short inputs, NaN on long ones."""
    scores = l2(values).T
    return scores / 0.0 * 0.0 if keys.shape[0] > LATE else scores

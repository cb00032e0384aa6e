"""Carries out one policy decision on one request's paged KV: the worker-side mechanism.

It reads the request's K/V through a backend view, asks the policy, and either drops a block
(decode, block policies: nothing moves) or compacts the kept tokens into the request's first
slots (prefill, and decode for token policies) so that whole tail blocks become free. It returns
which of the request's blocks to release; the scheduler side returns them to vLLM's pool.
Nothing here imports vLLM, so the Hugging Face reference engine runs the same code path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from harness.engine.kv_view import KVView, slots
from policies import BlockPolicy, Policy, TokenPolicy

Phase = Literal["prefill", "decode"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Eviction:
    phase: Phase
    dropped_blocks: tuple[int, ...]  # positions in the request's block list, ascending
    evicted_tokens: int              # physical length before minus after
    copied_tokens: int               # token slots rewritten by compaction (all layers and heads)


def phase_due(policy: Policy, prompt_len: int, computed_before: int, computed_after: int, evicted: int) -> Phase | None:
    """Whether this step ends with an eviction, from the request's logical counts.

    Prefill eviction follows the step that completes the prompt (attention ran over all of it);
    decode eviction follows a generation step after which the newest block is full past budget.
    """
    if not policy.evicts:
        return None
    if computed_before < prompt_len <= computed_after:
        return "prefill" if policy.needs_prefill_eviction(prompt_len) else None
    if computed_before >= prompt_len and policy.needs_decode_eviction(computed_after - evicted):
        return "decode"
    return None


def compact(view: KVView, keys, values, kept: torch.Tensor, blocks, offsets) -> int:
    """Pack ``kept`` ([layers, heads, n] source indices) into slots 0..n-1; returns slots rewritten.

    Slots before the first index that moves keep their contents; everything from there on is
    gathered first and then written, so overlapping sources and destinations are safe.
    """
    count = kept.shape[-1]
    identity = torch.arange(count, device=kept.device)
    moved = (kept != identity).flatten(0, 1).any(dim=0)
    if not moved.any():
        return 0
    first = int(moved.nonzero()[0])
    index = kept[..., first:].permute(0, 2, 1)  # [layers, n - first, heads]
    index = index.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    new_keys = torch.gather(keys, 1, index)
    new_values = torch.gather(values, 1, index)
    view.write(blocks[first:count], offsets[first:count], new_keys, new_values)
    return count - first


def evict(policy: Policy, view: KVView, block_ids: list[int], tokens: int, phase: Phase) -> Eviction:
    """Apply the policy to a request holding ``tokens`` physical tokens in ``block_ids``."""
    block_size = policy.block_size
    keys, values = view.read_prefix(block_ids, tokens)
    held_blocks = cdiv(tokens, block_size)

    if phase == "decode" and isinstance(policy, BlockPolicy):
        victim = policy.decode_evict_block(keys, values)
        return Eviction(phase, (victim,), block_size, 0)

    if phase == "prefill":
        kept = policy.prefill_keep(keys, values)
    elif isinstance(policy, TokenPolicy):
        kept = policy.decode_keep(keys, values)
    else:
        raise TypeError(f"{type(policy).__name__} cannot evict in {phase}")
    blocks, offsets = slots(block_ids, tokens, block_size, keys.device)
    copied = compact(view, keys, values, kept, blocks, offsets)
    remaining = kept.shape[-1]
    dropped = tuple(range(cdiv(remaining, block_size), held_blocks))
    return Eviction(phase, dropped, tokens - remaining, copied)

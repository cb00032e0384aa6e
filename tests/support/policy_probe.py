"""A policy's decisions from whole ``[layers, tokens, heads, dim]`` K/V tensors, as tests ask them.

The engine scores a layer at a time through a paged view (``harness.eviction.evictor``); these
helpers score every layer of plain tensors and ask the same selection, so a test can state a
policy's rule on a handful of tokens."""
from __future__ import annotations

import torch

from policies import BlockPolicy, Policy, TokenPolicy


def scores_of(policy: Policy, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> torch.Tensor | None:
    """``[scored layers, heads, tokens]`` scores (an attention-aware policy also gets one
    ``Window`` per layer); None for a policy that decides from positions alone."""
    if not policy.needs_kv:
        return None
    layers = policy.scored_layers(keys.shape[0])
    if policy.query_window:
        return torch.stack([policy.layer_scores(keys[l], values[l], windows[l]) for l in layers])
    return torch.stack([policy.layer_scores(keys[l], values[l]) for l in layers])


def prefill_keep(policy: Policy, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> torch.Tensor:
    """``[layers, heads, kept]`` prompt tokens that survive prefill."""
    layers, tokens, heads, _ = keys.shape
    return policy.select_prefill(scores_of(policy, keys, values, windows), tokens, layers, heads)


def decode_keep(policy: TokenPolicy, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> torch.Tensor:
    """``[layers, heads, budget]`` tokens a token policy keeps at a decode eviction."""
    layers, tokens, heads, _ = keys.shape
    return policy.select_decode(scores_of(policy, keys, values, windows), tokens, layers, heads)


def decode_evict_block(policy: BlockPolicy, keys: torch.Tensor, values: torch.Tensor, windows: list | None = None) -> int:
    """The position of the block a block policy drops at a decode eviction."""
    return policy.select_victim(scores_of(policy, keys, values, windows), keys.shape[1])


def assert_pool_holds(view, blocks: list[int], kept_blocks, kept: torch.Tensor, keys, values) -> None:
    """What the evictor left in the paged pool (``view``, read through the blocks it kept) is exactly
    the plain rule's ``kept`` ``[layers, heads, kept]`` entries of the per-layer ``[heads, tokens,
    dim]`` ``keys``/``values``: same tokens, same order, bit for bit."""
    slots = [blocks[position] for position in kept_blocks]
    for layer in range(len(keys)):
        left_keys, left_values = view.read_layer(layer, slots, 0, kept.shape[-1])
        index = kept[layer].T.unsqueeze(-1).expand(-1, -1, keys[layer].shape[-1])
        torch.testing.assert_close(left_keys, keys[layer].permute(1, 0, 2).gather(0, index), rtol=0, atol=0)
        torch.testing.assert_close(left_values, values[layer].permute(1, 0, 2).gather(0, index), rtol=0, atol=0)

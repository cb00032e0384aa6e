"""Views of a paged KV cache as plain ``[tokens, kv_heads, head_dim]`` tensors, one layer at a time.

Policies never see a layout; the evictor reads and writes token slots through a view. vLLM's
backends get theirs in ``harness.engine.backend_views`` (the layouts are vLLM's internals), the
Hugging Face reference its own (``harness.eviction.hf_reference.DynamicCacheView``).
"""
from __future__ import annotations

import torch


class KVView:
    """Reads and writes the K/V of a request's token slots, one layer at a time.

    Subclasses say how to gather and scatter slots ``(block id, offset)`` of one layer as
    ``[tokens, kv_heads, head_dim]`` tensors in the cache's own dtype.
    """

    def __init__(self, layers: list[torch.Tensor], block_size: int):
        self.layers = layers
        self.block_size = block_size

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def read_layer(self, layer: int, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[start, end)`` of a request whose blocks are ``block_ids``."""
        positions = torch.arange(start, end, device=self.device)
        table = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self._gather(layer, table[positions // self.block_size], positions % self.block_size)

    def write_layer(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
        self._scatter(layer, blocks.to(self.device), offsets.to(self.device), keys, values)

    def _gather(self, layer, blocks, offsets):
        raise NotImplementedError

    def _scatter(self, layer, blocks, offsets, keys, values):
        raise NotImplementedError

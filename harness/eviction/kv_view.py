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

    # The most bytes one layer's joint read of several requests may take (None: no limit): reads
    # stay small enough for the CPU's caches, and eviction scratch bounded on a GPU.
    joint_read_bytes: int | None = None

    def __init__(self, layers: list[torch.Tensor], block_size: int):
        self.layers = layers
        self.block_size = block_size

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.num_heads * self.head_dim * self.layers[0].element_size() if self.layers else 0

    @property
    def head_dim(self) -> int:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def locate(self, runs: list[tuple[list[int], int, int]]) -> "Slots":
        """Where the slots ``[start, end)`` of each run ``(block ids, start, end)`` live, found once
        (on the cache's device) for reading them, concatenated in run order, from every layer."""
        positions = [torch.arange(start, end, device=self.device) for _, start, end in runs]
        tables = [torch.tensor(block_ids, dtype=torch.long, device=self.device) for block_ids, _, _ in runs]
        blocks = torch.cat([table[p // self.block_size] for table, p in zip(tables, positions)])
        offsets = torch.cat([p % self.block_size for p in positions])
        parts, base = [], 0
        for _, start, end in runs:
            parts.append(slice(base, base + end - start))
            base += end - start
        return Slots(parts, blocks=blocks, offsets=offsets)

    def read(self, layer: int, slots: "Slots", values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys and values ``[rows, kv_heads, head_dim]`` of located slots in one layer (values
        None when not asked for); run i is rows ``slots.parts[i]`` (a view may read more rows than
        the runs hold)."""
        keys, read_values = self._gather(layer, slots.blocks, slots.offsets)
        return keys, read_values if values else None

    def read_layer(self, layer: int, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[start, end)`` of a request whose blocks are ``block_ids``."""
        slots = self.locate([(block_ids, start, end)])
        keys, values = self.read(layer, slots)
        return keys[slots.parts[0]], values[slots.parts[0]]

    def write_layer(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
        self._scatter(layer, blocks.to(self.device), offsets.to(self.device), keys, values)

    def _gather(self, layer, blocks, offsets):
        raise NotImplementedError

    def _scatter(self, layer, blocks, offsets, keys, values):
        raise NotImplementedError


class Slots:
    """Located runs of slots: ``parts[i]``, the rows of run i in what ``KVView.read`` returns, and
    whatever index the view reads them with."""

    def __init__(self, parts: list[slice], **index):
        self.parts = parts
        self.__dict__.update(index)

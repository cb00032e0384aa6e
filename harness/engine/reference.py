"""The correctness oracle: greedy generation in Hugging Face transformers with an explicit cache,
applying the same policy decisions at the same steps as the patched vLLM. No vLLM involved.

The cache is a ``DynamicCache`` whose per-layer ``[1, heads, tokens, dim]`` tensors are exposed
to the shared evictor (``harness.engine.evictor``) as if they were paged: "block" b of the
request is tokens ``[b*B, (b+1)*B)``. After an eviction the dropped blocks are cut out and the
tail trimmed to the physical length, which is what vLLM's block table sees. RoPE positions stay
logical (``position_ids``) while the cache holds fewer tokens, as in the engine.
"""
from __future__ import annotations

import torch

from harness.engine.evictor import ScoreBook, evict, phase_due
from harness.engine.kv_view import KVView
from policies import Policy


class DynamicCacheView(KVView):
    """A DynamicCache's layers seen through the KVView interface (block ids = block positions)."""

    def __init__(self, cache, block_size: int):
        self.cache = cache
        super().__init__([layer.keys for layer in cache.layers], block_size)

    @property
    def num_heads(self) -> int:
        return self.cache.layers[0].keys.shape[1]

    def _index(self, blocks, offsets):
        return blocks * self.block_size + offsets

    def _gather(self, layer, blocks, offsets):
        entry = self.cache.layers[layer]
        index = self._index(blocks, offsets)
        return entry.keys[0, :, index].transpose(0, 1), entry.values[0, :, index].transpose(0, 1)

    def _scatter(self, layer, blocks, offsets, keys, values):
        entry = self.cache.layers[layer]
        index = self._index(blocks, offsets)
        entry.keys[0, :, index] = keys.transpose(0, 1)
        entry.values[0, :, index] = values.transpose(0, 1)

    def drop(self, dropped_blocks: tuple[int, ...], remaining_tokens: int) -> None:
        """Cut the dropped blocks out of every layer and keep ``remaining_tokens`` tokens."""
        length = self.cache.layers[0].keys.shape[2]
        keep = torch.ones(length, dtype=torch.bool)
        for block in dropped_blocks:
            keep[block * self.block_size : (block + 1) * self.block_size] = False
        index = keep.nonzero().squeeze(1)[:remaining_tokens]
        for entry in self.cache.layers:
            entry.keys = entry.keys[:, :, index].contiguous()
            entry.values = entry.values[:, :, index].contiguous()
        self.layers = [entry.keys for entry in self.cache.layers]


class ReferenceEngine:
    """One request at a time, greedy, float32: slow and simple on purpose."""

    def __init__(self, model_path: str, policy: Policy | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="eager")
        self.model = self.model.to(device).eval()
        self.device = torch.device(device)
        self.policy = policy
        self.book = ScoreBook()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
        return self.generate_with_top_logprobs(prompt_ids, max_new_tokens, eos_token_id)[0]

    @torch.no_grad()
    def generate_with_top_logprobs(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                                   top: int = 3) -> tuple[list[int], list[list[list]]]:
        """Output ids and, per position, the ``top`` best ``[token, logprob]`` pairs (the engine
        runs' format, for the near-tie rule)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.book.forget(list(self.book.scores))  # one request at a time: a fresh request
        prompt_len = len(prompt_ids)
        inputs = torch.tensor([prompt_ids], device=self.device)
        positions = torch.arange(prompt_len, device=self.device).unsqueeze(0)
        computed, evicted, output, best = 0, 0, [], []
        while len(output) < max_new_tokens:
            logits = self.model(
                input_ids=inputs,
                position_ids=positions,
                cache_position=torch.arange(computed - evicted, computed - evicted + inputs.shape[1], device=self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position is sampled; skip the prompt's logits
            ).logits
            before, computed = computed, computed + inputs.shape[1]
            token = int(logits[0, -1].argmax())
            output.append(token)
            logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1).topk(top)
            best.append([[int(i), float(v)] for v, i in zip(logprobs.values, logprobs.indices)])
            if eos_token_id is not None and token == eos_token_id:
                break
            if self.policy is not None:
                phase = phase_due(self.policy, prompt_len, before, computed, evicted)
                if phase is not None:
                    evicted += self._evict(cache, computed - evicted, phase)
            inputs = torch.tensor([[token]], device=self.device)
            positions = torch.tensor([[computed]], device=self.device)
        return output, best

    def _evict(self, cache, physical: int, phase) -> int:
        view = DynamicCacheView(cache, self.policy.block_size)
        blocks = -(-physical // self.policy.block_size)
        eviction = evict(self.policy, view, list(range(blocks)), physical, phase, self.book)
        if eviction.evicted_tokens or eviction.changes_blocks:
            view.drop(eviction.dropped_blocks, physical - eviction.evicted_tokens)
        return eviction.evicted_tokens

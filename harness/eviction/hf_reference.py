"""The correctness oracle: greedy generation in Hugging Face transformers with an explicit cache,
applying the same policy decisions at the same steps as the patched vLLM. No vLLM involved.

The cache is a ``DynamicCache`` whose per-layer ``[1, heads, tokens, dim]`` tensors are exposed
to the shared evictor (``harness.eviction.evictor``) as if they were paged: "block" b of the
request is tokens ``[b*B, (b+1)*B)``. After an eviction the dropped blocks are cut out and the
tail trimmed to the physical length, which is what vLLM's block table sees. RoPE positions stay
logical (``position_ids``) while the cache holds fewer tokens, as in the engine. With
``context_tokens`` (query-agnostic compression, ``compress=context``) the prefill eviction follows
the pass over the prompt's first ``context_tokens`` tokens, as if they were the prompt; the rest
(the question) then runs as one pass over what stayed, and nothing is evicted after it. For an
attention-aware policy the model runs a registered attention function (Hugging Face's own
``AttentionInterface``) that hands each layer's post-RoPE queries to the request's window and then
runs the model's eager attention unchanged.
"""
from __future__ import annotations

import sys

import torch

from harness.eviction.evictor import count_due, count_queries, evict, phase_due
from harness.eviction.state import PolicyState
from harness.eviction.kv_view import KVView
from policies import Policy


class DynamicCacheView(KVView):
    """A DynamicCache's layers seen through the KVView interface (block ids = block positions)."""

    def __init__(self, cache, block_size: int):
        self.cache = cache
        super().__init__([layer.keys for layer in cache.layers], block_size)

    @property
    def num_heads(self) -> int:
        return self.cache.layers[0].keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.cache.layers[0].keys.shape[-1]

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


def window_attention_implementation(base: str = "eager") -> str:
    """Register and name a Hugging Face attention implementation (each call re-registers the same
    name) that hands each layer's post-RoPE queries (``[new tokens, query_heads, head_dim]``) to
    the attention module's ``kv_report_queries(layer, queries)``, if it has one, and then runs
    ``base`` ("eager", the model's own eager attention, or a registered one such as "sdpa")
    unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"kv_harness_window_{base}"

    def attention(module, query, key, value, attention_mask, scaling, **kwargs):
        report = getattr(module, "kv_report_queries", None)
        if report is not None:
            report(module.layer_idx, query[0].transpose(0, 1))
        if base == "eager":
            run = sys.modules[type(module).__module__].eager_attention_forward
        else:
            run = ALL_ATTENTION_FUNCTIONS[base]
        return run(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask if base == "eager" else ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


class HFReferenceEngine:
    """One request at a time, greedy, float32: slow and simple on purpose."""

    def __init__(self, model_path: str, policy: Policy | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.window = policy.query_window if policy is not None else 0
        attention = window_attention_implementation("eager") if self.window else "eager"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attention)
        self.model = self.model.to(device).eval()
        self.device = torch.device(device)
        self.policy = policy
        self.step_queries: dict[int, torch.Tensor] = {}
        self.attention_layers = [layer.self_attn for layer in self.model.model.layers]
        for layer in self.attention_layers:
            layer.kv_report_queries = self.step_queries.__setitem__
        self.policy_state = PolicyState()

    def _observe(self, request_id: str) -> None:
        """This step's queries (each layer's newest ``window``) into the request's window."""
        if not self.window:
            return
        queries = torch.stack([self.step_queries[layer][-self.window:] for layer in range(len(self.attention_layers))])
        self.policy_state.observe(request_id, queries, self.window)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                 context_tokens: int | None = None) -> list[int]:
        return self.generate_with_top_logprobs(prompt_ids, max_new_tokens, eos_token_id,
                                               context_tokens=context_tokens)[0]

    def generate_with_top_logprobs(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                                   top: int = 3, context_tokens: int | None = None) -> tuple[list[int], list[list[list]]]:
        """Output ids and, per position, the ``top`` best ``[token, logprob]`` pairs (the engine
        runs' format, for the near-tie rule). ``context_tokens``: evict after the prompt's first
        ``context_tokens`` tokens, before the question (the rest) is computed; None: after the prompt."""
        output, best, _ = self._decode(prompt_ids, max_new_tokens, eos_token_id, top, None, context_tokens)
        return output, best

    def forced_logprobs(self, prompt_ids: list[int], forced: list[int], context_tokens: int | None = None) -> list[float]:
        """Teacher forcing: the model's log-probability of each of ``forced`` in turn, the cache
        evicted exactly as if the model had generated them (the engine's forced decoding)."""
        return self._decode(prompt_ids, len(forced), None, 1, forced, context_tokens)[2]

    @torch.no_grad()
    def _decode(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None, top: int,
                forced: list[int] | None, context_tokens: int | None = None
                ) -> tuple[list[int], list[list[list]], list[float]]:
        from transformers import DynamicCache

        prompt_len = len(prompt_ids)
        evict_at = prompt_len if context_tokens is None else context_tokens  # where the prefill eviction runs
        if not 0 < evict_at <= prompt_len:
            raise ValueError(f"context_tokens={context_tokens} for a prompt of {prompt_len} tokens")
        if evict_at < prompt_len and self.policy is not None and self.policy.evicts and self.policy.decode_eviction:
            # A decode eviction would drop question tokens too: the setting compresses the context once.
            raise ValueError("context compression evicts the context only: the policy needs decode_eviction=False")
        cache = DynamicCache(config=self.model.config)
        # One request at a time: each starts with empty policy state.
        self.policy_state = PolicyState(scales=[float(layer.scaling) for layer in self.attention_layers])
        inputs = torch.tensor([prompt_ids[:evict_at]], device=self.device)
        positions = torch.arange(evict_at, device=self.device).unsqueeze(0)
        computed, evicted, output, best, chosen = 0, 0, [], [], []
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
            self._observe("request")
            if computed < prompt_len:  # the context is in: evict it, then the question runs on what stayed
                evicted = self._after_step(cache, evict_at, before, computed, evicted)
                inputs = torch.tensor([prompt_ids[computed:]], device=self.device)
                positions = torch.arange(computed, prompt_len, device=self.device).unsqueeze(0)
                continue
            token = int(logits[0, -1].argmax()) if forced is None else forced[len(output)]
            output.append(token)
            all_logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
            chosen.append(float(all_logprobs[token]))
            logprobs = all_logprobs.topk(top)
            best.append([[int(i), float(v)] for v, i in zip(logprobs.values, logprobs.indices)])
            if eos_token_id is not None and token == eos_token_id:
                break
            evicted = self._after_step(cache, evict_at, before, computed, evicted)
            inputs = torch.tensor([[token]], device=self.device)
            positions = torch.tensor([[computed]], device=self.device)
        return output, best, chosen

    def _after_step(self, cache, evict_at: int, before: int, computed: int, evicted: int) -> int:
        """The eviction or query counting due after a pass that took the request from ``before``
        to ``computed`` logical tokens, with ``evict_at`` standing for the prompt's length (the
        engine's rule, ``phase_due``); returns the tokens evicted so far."""
        if self.policy is None:
            return evicted
        phase = phase_due(self.policy, evict_at, before, computed, evicted)
        if phase is not None:
            evicted += self._evict(cache, computed - evicted, phase)
        elif count_due(self.policy, evict_at, before, computed, self.policy_state, "request"):
            physical = computed - evicted
            view = DynamicCacheView(cache, self.policy.block_size)
            count_queries(self.policy, view, list(range(-(-physical // self.policy.block_size))), physical,
                          self.policy_state, "request")
        return evicted

    def _evict(self, cache, physical: int, phase) -> int:
        view = DynamicCacheView(cache, self.policy.block_size)
        blocks = -(-physical // self.policy.block_size)
        eviction = evict(self.policy, view, list(range(blocks)), physical, phase, self.policy_state, "request")
        if eviction.evicted_tokens or eviction.changes_blocks:
            view.drop(eviction.dropped_blocks, physical - eviction.evicted_tokens)
        return eviction.evicted_tokens

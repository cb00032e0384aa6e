"""KVzip's reconstruction passes inside the worker, in the step whose prefill reaches the eviction point.

A policy whose score ``reconstructs`` (``policies.kvzip``) is scored by extra model forwards: for
each chunk of the request's context, the model reads ``repeat prompt + footer + chunk`` over the
request's cached context, at positions c.. (c the eviction point), and each context token's score is
the largest attention the pass's queries pay it (``policies.kvzip.chunk_scores``). They run here,
after the step's own forward wrote the context's last K/V and before its evictions
(``worker_patch.wrap_sample_tokens``), one request at a time, each pass in pieces of at most
``max_num_batched_tokens`` tokens (the activations vLLM profiled for).

This is the design's option C (``docs/design_kvzip.md`` §4.3) with one change that removes its
deepest tie to vLLM: the passes' attention is not vLLM's kernel but PyTorch's, over the request's
context K/V read through the harness's own view (``KVView``, the evictor's reader) and the pass's own
K/V held in memory. So the passes write nothing to the paged cache: no scratch blocks, no slot
mapping, no hand-built attention metadata, nothing the scheduler must allocate or count; the
request's ``num_computed_tokens`` never includes them, so its question and decode run at c.. with
no rewind (the issue's "continues from the context's end"). The cost: the passes' attention runs in
PyTorch, tiled over queries (``TILE``), not in the paged kernel.

A context's scores depend on its K/V and its reconstruction ids and the score's options, never on
the request's budget or question, so the worker keeps the scores of recent contexts
(``RecentScores``, host memory, ``RECENT_SCORES_BYTES``): a sweep over ratios (every cell's request
for a prompt has the same context), or a context asked again after its compressed copy was dropped,
runs its passes once. A context is named as vLLM names a block of its prefix cache
(``score_key``): its token ids and what vLLM hashes with them, the LoRA adapter, the multimodal
items and the cache salt, so a context shares scores exactly where it could share cached blocks.
A prefix-cache reset (weights may have changed) empties it: the scheduler counts resets in its plan
(``forget_before``). The ledger's ``reconstruct_tokens`` and ``reconstruct_s`` count the passes that
ran, and ``reconstruct_reused`` the contexts that took their scores from here instead.

What this relies on in vLLM 0.32 (cited where used):

* ``Attention.forward(query, key, value, output_shape=None, output_dtype=None)`` receives post-RoPE
  ``[tokens, heads * head_size]`` query and key (``vllm/model_executor/layers/attention/attention.py:
  488-497``; Llama calls it after ``rotary_emb`` at ``vllm/model_executor/models/llama.py:231-232``)
  and returns ``[tokens, num_heads * head_size_v]`` (``attention.py:524-527``); it is replaced, on the
  module instance, for the passes only (``patches.replaced_on``, listed in ``harness.engine.patches``
  with its parameters): ``nn.Module.__call__`` calls ``self.forward``, so every registered hook (the
  query capture's, idle then) still runs.
* The model is called as the runner calls it (``GPUModelRunner._model_forward``,
  ``vllm/v1/worker/gpu_model_runner.py:3620-3651``: ``input_ids``, ``positions``,
  ``intermediate_tensors``, ``inputs_embeds``), inside ``set_forward_context`` with no attention
  metadata, as the runner's dummy runs do (``gpu_model_runner.py:5831-5849``;
  ``vllm/forward_context.py:278-289``). In eager mode the compile decorator calls ``forward``
  directly (``vllm/compilation/decorators.py:402-407, 528-529``), which is why the policy needs
  enforce_eager (also for the query hooks).
* ``CachedRequestState.prompt_token_ids``, ``block_ids`` and ``num_computed_tokens`` (the value
  before the step; ``vllm/v1/worker/gpu_input_batch.py:35-44``), its ``lora_request``,
  ``mm_features`` and ``prompt_embeds`` (``:38, 49-50``) for ``score_key``, the runner's ``vllm_config``,
  ``scheduler_config``, ``device`` (``gpu_model_runner.py:476-492``; ``CPUModelRunner`` subclasses
  it) and ``model`` (``:5057``, eager: no CUDA-graph or micro-batch wrapper, ``:5200-5224``), and
  ``scheduler_config.max_num_batched_tokens`` (``:516``).
* The layer's softmax scale is its backend's ``impl.scale`` (``vllm/v1/attention/backends/
  cpu_attn.py:304``), read once by ``QueryCapture``.

On a hybrid model (Gemma 3, issue 66) the passes run through every layer, but only the
full-attention layers are scored (the sliding-window layers never evict). A sliding-window layer
(its module's ``sliding_window``, ``vllm/model_executor/layers/attention/attention.py:339``) reads
what vLLM's kernel would: the context's last ``window - 1`` tokens, which its KV cache group still
holds when the prefill reaches c (vLLM frees only tokens before ``computed - window + 1``, with
``computed`` < c the tokens before this step: ``SlidingWindowManager.get_num_skipped_tokens``,
``vllm/v1/core/single_type_kv_cache_manager.py:1135-1170``, called from ``allocate_slots``,
``vllm/v1/core/kv_cache_manager.py:545-558``), and the pass's own tokens, each query within
``window`` positions of itself, its own included.

Under tensor parallelism every rank runs the same passes in the same order (the model's all-reduces
stay in step), scores its own KV heads, and the scores are gathered across ranks before they are
stored, so every rank holds every head's, as the evictor expects (``HeadShards.gather_heads``).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from harness.engine import patches
from harness.eviction.evictor import phase_due
from policies.kvzip import causal_tiles, chunk_scores, passes, with_sinks

TILE = 256  # queries per attention tile in the passes: bounds one layer's logits
# Host memory for recent contexts' scores: 30 layers x 3 KV heads x 2k tokens (SmolLM2) is 0.7 MB a
# context, 32 x 8 x 32k (Llama-3.1-8B) 32 MB: a sweep's contexts fit, a server's recent ones.
RECENT_SCORES_BYTES = 256 << 20


@dataclass
class Done:
    """What one step's passes cost: tokens run through the model and seconds spent (a context whose
    scores were reused counts its lookup's seconds only), and the contexts reused."""

    tokens: int = 0
    seconds: float = 0.0
    reused: int = 0


class RecentScores:
    """The scores of recently reconstructed contexts, newest last, within ``limit`` bytes: each
    group's ``[layers, heads, context]`` with the sinks already on top, on the host."""

    def __init__(self, limit: int = RECENT_SCORES_BYTES):
        self.limit, self.held = limit, 0
        self.entries: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()

    def get(self, key: tuple, device) -> list[torch.Tensor] | None:
        parts = self.entries.get(key)
        if parts is None:
            return None
        self.entries.move_to_end(key)
        return [part.to(device, copy=True) for part in parts]  # the request's own: the evictor may write

    def put(self, key: tuple, parts: list[torch.Tensor]) -> None:
        size = sum(part.numel() * part.element_size() for part in parts)
        if key in self.entries or size > self.limit:
            return
        while self.held + size > self.limit:
            _, dropped = self.entries.popitem(last=False)
            self.held -= sum(part.numel() * part.element_size() for part in dropped)
        self.entries[key] = [part.to("cpu", copy=True) for part in parts]
        self.held += size

    def clear(self) -> None:
        self.entries.clear()
        self.held = 0


def score_key(request, point: int, spec, score, cache_salt: str | None) -> tuple:
    """What a context's scores depend on: its token ids, what vLLM hashes with them to name a block
    of its prefix cache (``generate_block_hash_extra_keys``, ``vllm/v1/core/kv_cache_utils.py:625-663``),
    the reconstruction ids and the score's options.

    vLLM's extra keys, from the worker's request state (``CachedRequestState``,
    ``vllm/v1/worker/gpu_input_batch.py:35-50``, filled from ``NewRequestData`` at
    ``vllm/v1/worker/gpu_model_runner.py:1275-1288``): the LoRA adapter (vLLM keys its name and path,
    ``kv_cache_utils.py:578-595``; its id as well here), whose weights change every K/V; each
    multimodal item the context holds, by its identifier and place (``:510-575``; a prefix-cached
    item's data is stripped before it reaches the worker, its ``identifier`` and ``mm_position``
    kept: ``vllm/multimodal/utils.py:213-245``), whose embeddings stand behind placeholder ids; and
    the cache salt (``kv_cache_utils.py:647-650``), which keeps one tenant's contexts from another's:
    a reused context would show in its prefill time. The worker's state has no cache salt (the
    scheduler's ``Request`` has, ``vllm/v1/request.py:185``): the plan carries it. (Prompt embeddings,
    vLLM's fourth key, never reach here: ``Reconstruction.run`` refuses them.)"""
    lora = request.lora_request
    return (tuple(request.prompt_token_ids[:point]), spec, type(score).__name__, score.chunk_size, score.postfix,
            score.n_sink,
            None if lora is None else (lora.lora_name, lora.lora_int_id, lora.lora_path),
            tuple((item.identifier, item.mm_position.offset, item.mm_position.length)
                  for item in request.mm_features if item.mm_position.offset < point),
            cache_salt)


def pass_attention(query: torch.Tensor, context_keys: torch.Tensor, context_values: torch.Tensor,
                   own_keys: torch.Tensor, own_values: torch.Tensor, scale: float, tile: int = TILE,
                   window: int | None = None) -> torch.Tensor:
    """``[n, query_heads, dim]`` attention output of a pass's newest n queries ``[n, query_heads,
    dim]`` over the whole cached context (``[c, kv_heads, dim]``) and the pass's own K/V so far
    (``[m, kv_heads, dim]``, m >= n, causal: query j reads own tokens up to m - n + j): what vLLM's
    kernel computes for a prefill of the pass on top of the context, in float32. ``window``: a
    sliding-window layer's, whose ``context_keys`` are the context's last tokens just before the
    pass (see ``Reconstruction``)."""
    query_heads, kv_heads = query.shape[1], own_keys.shape[1]
    values = torch.cat([context_values, own_values]).float().permute(1, 0, 2)  # [kv_heads, c + m, dim_v]
    out = []
    for first, last, probabilities in causal_tiles(query, context_keys, own_keys, scale, tile, window):
        rows = last - first
        probabilities = probabilities.reshape(kv_heads, -1, probabilities.shape[-1])  # [kv_heads, group * rows, c + m]
        attended = torch.bmm(probabilities, values).view(kv_heads, -1, rows, values.shape[-1])
        out.append(attended.permute(2, 0, 1, 3).reshape(rows, query_heads, -1))
    return torch.cat(out)


class Reconstruction:
    """The passes of one worker: its attention modules (in KV-cache layer order), each KV cache
    group's view and layers, its head shards. ``run`` does one step's passes."""

    def __init__(self, runner, modules: list, scales: list[float], views: list, group_layers: list[list[int]],
                 shards, forward_context=None):
        self.runner, self.modules, self.scales = runner, modules, scales
        # (a test without vLLM gives its own; the engine enters vLLM's forward context)
        self.forward_context = forward_context or self._vllm_forward_context
        self.views, self.group_layers, self.shards = views, group_layers, shards
        # Each group's sliding window (None: full attention, the layers the passes score).
        self.windows = [getattr(modules[layers[0]], "sliding_window", None) for layers in group_layers]
        # Layer i (KV-cache order) is layer `where[i][1]` of group `where[i][0]`'s view.
        self.where = {layer: (group, index) for group, layers in enumerate(group_layers)
                      for index, layer in enumerate(layers)}
        self.piece = int(runner.scheduler_config.max_num_batched_tokens)
        self.recent = RecentScores()
        self.resets = 0  # the scheduler's count of prefix-cache resets the scores were computed after

    def forget_before(self, resets: int) -> None:
        """Drop every kept score once the scheduler's prefix cache was reset (``resets``, its count in
        the plan, moved on): a reset may follow new weights, under which the same ids score otherwise."""
        if resets != self.resets:
            self.recent.clear()
            self.resets = resets

    def due(self, policies, point: int, before: int, after: int, evicted: tuple[int, ...]) -> list[bool]:
        """Per KV cache group, whether this step ends with its reconstructing policy's prefill eviction."""
        return [policy.reconstructs and phase_due(policy, point, before, after, done) == "prefill"
                for policy, done in zip(policies, evicted)]

    def run(self, request_id: str, request, settings, policies, states, due: list[bool] | None = None,
            cache_salt: str | None = None) -> Done:
        """The passes for one request whose prefill reached its eviction point ``c`` this step (its
        whole context cached, nothing evicted): its scores ``[group layers, heads, c]`` go to
        ``states[g].scores`` of each group whose eviction is ``due`` (every group: None); a group
        whose budget holds the whole context evicts nothing and keeps no scores. ``cache_salt``: the
        request's, from the plan (part of the kept scores' key)."""
        started = time.perf_counter()
        if request.prompt_embeds is not None:
            # the passes repeat the context by its ids; a prompt given (even in part) as embeddings has
            # none there (the worker's prompt_token_ids is None, or sentinels where prompt_is_token_ids is
            # False: vllm/v1/worker/gpu_input_batch.py:37, 50, 54-56; vllm/v1/request.py:147-160)
            raise ValueError("it repeats the context by its token ids, and this prompt was given as embeddings")
        point = settings.eviction_point(len(request.prompt_token_ids))
        acting = next(policy for policy in policies if policy.reconstructs)  # (a hybrid model's windows' do not)
        spec, score = settings.reconstruction, acting.score
        if spec is None:  # (admission refuses it; a request reaching here without ids is a bug)
            raise RuntimeError(f"request {request_id}: {acting.name} has no reconstruction ids")
        context = request.prompt_token_ids[:point]
        # every rank computes the same key: their passes stay in step
        key = score_key(request, point, spec, score, cache_salt)
        gathered = self.recent.get(key, self.runner.device)
        reused, tokens = gathered is not None, 0
        if not reused:
            gathered, tokens = self._scores(context, point, request, spec, score)
            self.recent.put(key, gathered)
        for group, (policy, part) in enumerate(zip(policies, gathered)):
            if policy.reconstructs and (due is None or due[group]):
                states[group].scores[request_id] = part
        return Done(tokens, time.perf_counter() - started, reused=int(reused))

    def _scores(self, context: list[int], point: int, request, spec, score) -> tuple[list[torch.Tensor], int]:
        """Every group's ``[layers, heads, point]`` scores from the passes over the request's cached
        context, the sinks on top, and the tokens the passes ran."""
        device = self.runner.device
        kv_heads = self.views[0].num_heads
        # a sliding-window group is never scored: no scores (its policy never evicts)
        scores = [torch.zeros(view.num_layers, kv_heads, 0 if window else point, device=device)
                  for view, window in zip(self.views, self.windows)]
        # The context's slots in every group: logical = physical before the first eviction; a
        # sliding-window group's, the tokens the pass's first query reads (blocks before them are freed).
        slots = [view.locate([(request.block_ids[group], max(0, point - window + 1) if window else 0, point)])
                 for group, (view, window) in enumerate(zip(self.views, self.windows))]
        tokens = 0
        for ids, start, end in passes(context, spec.prefix_tokens, spec.first, spec.later, spec.suffix,
                                      score.chunk_size, score.postfix):
            own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            sinks = min(score.n_sink, start)
            for offset in range(0, len(ids), self.piece):
                piece = ids[offset : offset + self.piece]
                self._forward(piece, point + offset, own, slots, scores, (sinks, start, end))
                tokens += len(piece)
        gathered = self.shards.gather_heads(scores)
        # The sinks above every score of every group (kvpress: the whole score's amax + 1); reading
        # the maximum also waits for the device, so the seconds are the passes'.
        top = max(float(part.max()) for part in gathered if part.numel())
        for part in gathered:
            with_sinks(part, score.n_sink, above=top)
        return list(gathered), tokens

    def _forward(self, ids: list[int], first_position: int, own: dict, slots: list, scores: list,
                 chunk: tuple[int, int, int]) -> None:
        """One piece of a pass through the model, with every attention layer replaced by
        ``pass_attention`` over the context and the pass's own K/V, scoring the chunk as it goes."""
        runner, device = self.runner, self.runner.device
        n = len(ids)
        input_ids = torch.tensor(ids, dtype=torch.int32, device=device)
        positions = torch.arange(first_position, first_position + n, dtype=torch.int64, device=device)
        with ExitStack() as replaced:  # every layer back to its own forward after the piece
            for layer, module in enumerate(self.modules):
                replaced.enter_context(patches.replaced_on(
                    module, "forward", self._attention(layer, module, own, slots, scores, chunk)))
            # No attention metadata: every attention layer's forward is ours (the runner's dummy runs
            # enter the same context without metadata, gpu_model_runner.py:5831-5849).
            with torch.inference_mode(), self.forward_context(n):
                runner.model(input_ids=input_ids, positions=positions, intermediate_tensors=None, inputs_embeds=None)

    def _vllm_forward_context(self, tokens: int):
        from vllm.forward_context import set_forward_context

        return set_forward_context(None, self.runner.vllm_config, num_tokens=tokens)

    def _attention(self, layer: int, module, own: dict, slots: list, scores: list, chunk: tuple[int, int, int]):
        group, index = self.where[layer]
        view, scale, window = self.views[group], self.scales[layer], self.windows[group]
        sinks, start, end = chunk

        def forward(query, key, value, output_shape=None, output_dtype=None):
            n = query.shape[0]
            q = query.view(n, module.num_heads, module.head_size)
            k = key.view(n, module.num_kv_heads, module.head_size)
            v = value.view(n, module.num_kv_heads, module.head_size_v)
            if layer in own:  # a pass run in pieces: the earlier pieces' K/V stay in memory
                k = torch.cat([own[layer][0], k])
                v = torch.cat([own[layer][1], v])
            own[layer] = (k, v)
            context_keys, context_values = view.read(index, slots[group])
            part = slots[group].parts[0]
            context_keys, context_values = context_keys[part], context_values[part]
            if window is None:
                received = chunk_scores(q, context_keys[:sinks], context_keys[start:end], k, scale)
                held = scores[group][index, :, start:end]
                torch.maximum(held, received.to(held.device), out=held)
            out = pass_attention(q, context_keys, context_values, k, v, scale, window=window)
            shape = output_shape if output_shape is not None else (n, module.num_heads * module.head_size_v)
            return out.to(output_dtype or query.dtype).reshape(shape)

        return forward

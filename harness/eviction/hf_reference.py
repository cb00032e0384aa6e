"""The correctness oracle: greedy generation in Hugging Face transformers with an explicit cache,
applying the same policy decisions at the same steps as the patched vLLM. No vLLM involved.

The cache is a ``DynamicCache`` whose per-layer ``[1, heads, tokens, dim]`` tensors are exposed
to the shared evictor (``harness.eviction.evictor``) as if they were paged: "block" b of the
request is tokens ``[b*B, (b+1)*B)``. After an eviction the dropped blocks are cut out and the
tail trimmed to the physical length, which is what vLLM's block table sees. RoPE positions stay
logical (``position_ids``) while the cache holds fewer tokens, as in the engine. With
``context_tokens`` (query-agnostic compression, ``compress=context``) the prefill eviction follows
the pass over the prompt's first ``context_tokens`` tokens, as if they were the prompt; the rest
(the question) then runs as one pass over what stayed, and nothing is evicted after it; what that
eviction keeps is the policy's (built for ``compress=context`` by ``build_policy``, it keeps whole
blocks: ``Policy.whole_blocks``). For an
attention-aware policy the model runs a registered attention function (Hugging Face's own
``AttentionInterface``) that hands each layer's post-RoPE queries to the request's window and then
runs the model's eager attention unchanged.

With several policies, one per KV cache group (``engine.layer_groups``, each a run of consecutive
layers with its own budget), each group's layers keep their own tokens: one view, policy state,
query window and evicted count per group, as the engine keeps them. The layers then hold different
numbers of tokens, so the registered attention function also builds each layer's causal mask for its
own keys (Hugging Face builds one mask, for the first layer's length). With ``schedule`` (settings at
``budget_schedule=attention``) the groups' budgets are measured from each prompt's last queries when
the prefill reaches the eviction point, as the engine's worker measures them
(``harness.eviction.layer_budgets``), and that eviction follows them; with ``schedule`` at
``budget_schedule=kvzip`` they are measured from the reconstruction's scores of every group
(KVzip's global threshold, ``kvzip_measured_settings``) before that eviction, as the worker does.

KVzip (a policy whose score ``reconstructs``, ``policies.kvzip``): when the prefill reaches the
eviction point c, the reference runs the reconstruction passes through the model on the request's
``DynamicCache`` (``reconstruction``: the request's ids, ``harness.eviction.settings.Reconstruction``),
at positions c.., each layer's post-RoPE queries handed over by the registered attention function
(the model's own attention over the whole cache computes the rest of the pass), scores them with the
policy's ``chunk_scores`` and cuts each pass's K/V off the cache again; the step driver then evicts
by those scores. The engine's worker runs the same passes with the attention computed apart
(``harness.engine.reconstruction``): this is the check of its orchestration.

A hybrid model (Gemma 3: ``layer_types`` with sliding-window layers): the policy evicts the
full-attention ("global") layers, one KV cache group, as the engine's does (its sliding-window
groups run ``FullCache``: ``harness.engine.layer_groups.policies_by_group``); a sliding-window layer
keeps Hugging Face's sliding cache (the last W - 1 tokens) and attends over the last W positions, its
own included, under a mask built here from what it holds (Hugging Face's would follow the global
layers' cache positions, which eviction moved). KVzip's passes run through every layer there, a
sliding-window layer over its window, its cache put back after each pass, and score the global
layers only. One policy, no measured schedule and no chained turn on such a model, as the engine
refuses them (``harness.eviction.admission.hybrid_refusal``).

Chained turns (``resume``, ``chain=true``): the next turn of a conversation continues the cache the
previous request left (its prompt and every output but the last, as evicted), computes its tokens
up to its context boundary at their logical positions, and the prefill eviction there runs, through
the same step driver, on the kept history and those tokens, by the turn's own policy (``use``: a
ratio's budget is each turn's own history's), as the engine's scheduler continues a chain entry.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Sequence

import torch

from harness.eviction.step import StepRequest, evict_step
from harness.eviction.layer_budgets import kvzip_measured_settings, measured_settings, spread_and_shift
from harness.eviction.settings import EvictionSettings, group_policies
from harness.eviction.state import PolicyState
from harness.eviction.kv_view import KVView
from policies import Policy
from policies.budget_schedules import ATTENTION_WINDOW


class DynamicCacheView(KVView):
    """A DynamicCache's layers seen through the KVView interface (block ids = block positions):
    all of them, or ``layers`` (one KV cache group's), numbered from 0 in the view."""

    def __init__(self, cache, block_size: int, layers: Sequence[int] | None = None):
        self.cache = cache
        self.entries = [cache.layers[layer] for layer in (layers if layers is not None else range(len(cache.layers)))]
        super().__init__([entry.keys for entry in self.entries], block_size)

    @property
    def num_heads(self) -> int:
        return self.entries[0].keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.entries[0].keys.shape[-1]

    def _index(self, blocks, offsets):
        return blocks * self.block_size + offsets

    def _gather(self, layer, blocks, offsets):
        entry = self.entries[layer]
        index = self._index(blocks, offsets)
        return entry.keys[0, :, index].transpose(0, 1), entry.values[0, :, index].transpose(0, 1)

    def _scatter(self, layer, blocks, offsets, keys, values):
        entry = self.entries[layer]
        index = self._index(blocks, offsets)
        entry.keys[0, :, index] = keys.transpose(0, 1)
        entry.values[0, :, index] = values.transpose(0, 1)

    def drop(self, dropped_blocks: tuple[int, ...], remaining_tokens: int) -> None:
        """Cut the dropped blocks out of the view's layers and keep ``remaining_tokens`` tokens."""
        length = self.entries[0].keys.shape[2]
        keep = torch.ones(length, dtype=torch.bool)
        for block in dropped_blocks:
            keep[block * self.block_size : (block + 1) * self.block_size] = False
        index = keep.nonzero().squeeze(1)[:remaining_tokens]
        for entry in self.entries:
            entry.keys = entry.keys[:, :, index].contiguous()
            entry.values = entry.values[:, :, index].contiguous()
        self.layers = [entry.keys for entry in self.entries]


def own_causal_mask(query, key, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask of ``query``'s tokens (the newest ones) over one layer's ``key``
    tokens, whatever that layer holds: query i sees every key up to its own, ``keys - queries + i``
    (Hugging Face's eager mask, built here per layer)."""
    queries, keys = query.shape[-2], key.shape[-2]
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
    mask = torch.zeros(queries, keys, dtype=dtype, device=query.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def own_window_mask(query, key, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of ``query``'s tokens over a sliding-window layer's ``key`` tokens (what it
    held, logically just before the queries, then the queries' own): query i sees the keys within
    ``window`` positions of it, its own included, causally."""
    queries, keys = query.shape[-2], key.shape[-2]
    at = torch.arange(queries, device=query.device)[:, None] + keys - queries
    slot = torch.arange(keys, device=query.device)[None, :]
    allowed = (slot <= at) & (at - slot < window)
    mask = torch.zeros(queries, keys, dtype=dtype, device=query.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def window_attention_implementation(base: str = "eager") -> str:
    """Register and name a Hugging Face attention implementation (each call re-registers the same
    name) that hands each layer's post-RoPE queries (``[new tokens, query_heads, head_dim]``) to
    the attention module's ``kv_report_queries(layer, queries)``, if it has one, and then runs
    ``base`` ("eager", the model's own eager attention, or a registered one such as "sdpa")
    unchanged; on a module marked ``kv_own_mask`` (layers holding their own numbers of tokens),
    with the causal mask of that layer's keys (``own_causal_mask``) instead of the model's, or, on
    one marked ``kv_window`` (a sliding-window layer), the window's (``own_window_mask``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"kv_harness_window_{base}"

    def attention(module, query, key, value, attention_mask, scaling, **kwargs):
        report = getattr(module, "kv_report_queries", None)
        if report is not None:
            report(module.layer_idx, query[0].transpose(0, 1))
        if getattr(module, "kv_window", None):
            attention_mask = own_window_mask(query, key, module.kv_window, query.dtype)
        elif getattr(module, "kv_own_mask", False):
            attention_mask = own_causal_mask(query, key, query.dtype)
        if base == "eager":
            run = sys.modules[type(module).__module__].eager_attention_forward
        else:
            run = ALL_ATTENTION_FUNCTIONS[base]
        return run(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask if base == "eager" else ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


class HFReferenceEngine:
    """One request at a time, greedy, float32: slow and simple on purpose.

    ``policy``: one policy for every layer, or a sequence of them, one per KV cache group of
    consecutive layers (group 0 the first layers), each with its own budget. ``schedule``: settings
    at the attention schedule, whose group budgets each prompt measures (``policy`` then gives the
    groups' policies before that, ``group_policies`` of the settings); ``measured_budgets`` holds
    the last prompt's."""

    def __init__(self, model_path: str, policy: Policy | list[Policy] | tuple[Policy, ...] | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", schedule: EvictionSettings | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.policies: tuple[Policy, ...] = tuple(policy) if isinstance(policy, (list, tuple)) else (policy,)
        self.schedule = schedule if schedule is not None and schedule.measuring else None
        if schedule is not None and self.schedule is None:
            raise ValueError(f"schedule: settings at a measured budget_schedule (attention, kvzip) not yet measured, "
                             f"got {schedule}")
        self.unmeasured = self.policies
        self.measured_budgets: tuple[int, ...] | None = None
        self.policy = self.policies[0]
        if len(self.policies) > 1 and any(p is None for p in self.policies):
            raise ValueError("every KV cache group needs its policy")
        self.window = self.policy.query_window if self.policy is not None else 0
        if any((p.query_window if p else 0) != self.window for p in self.policies):
            raise ValueError("the groups' policies must read the same query window")
        grouped = len(self.policies) > 1
        self.reconstructs = any(p is not None and p.reconstructs for p in self.policies)
        config = AutoConfig.from_pretrained(model_path)
        config = getattr(config, "text_config", None) or config
        # a hybrid model's sliding-window layers (the module's "hybrid model")
        self.local_layers = [i for i, kind in enumerate(getattr(config, "layer_types", None) or ())
                             if kind == "sliding_attention"]
        if self.local_layers and (grouped or self.schedule is not None):
            raise ValueError("a hybrid model: one policy on its global layers (no layer groups or measured "
                             "schedule), as the engine runs it")
        attention = (window_attention_implementation("eager") if self.window or grouped or self.schedule
                     or self.reconstructs or self.local_layers else "eager")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attention)
        self.model = self.model.to(device).eval()
        self.device = torch.device(device)
        self.step_queries: dict[int, torch.Tensor] = {}
        self.attention_layers = [layer.self_attn for layer in self.model.model.layers]
        layers, groups = len(self.attention_layers), len(self.policies)
        if layers % groups:
            raise ValueError(f"{groups} groups must divide the model's {layers} layers (equal groups, as the engine's)")
        size = layers // groups
        self.group_layers = [range(g * size, (g + 1) * size) for g in range(groups)]
        if self.local_layers:  # the one evicting group: the global layers
            self.group_layers = [[layer for layer in range(layers) if layer not in self.local_layers]]
        for index, layer in enumerate(self.attention_layers):
            if self.window or self.schedule or self.reconstructs:
                layer.kv_report_queries = self.step_queries.__setitem__
            layer.kv_own_mask = grouped or bool(self.local_layers)
            layer.kv_window = config.sliding_window if index in self.local_layers else None
        self.policy_states = [PolicyState() for _ in self.policies]

    @property
    def policy_state(self) -> PolicyState:
        """One group's (the only group's) policy state."""
        return self.policy_states[0]

    def _observe(self, request_id: str) -> None:
        """This step's queries (each layer's newest ``window``) into each group's window."""
        if not self.window:
            return
        for layers, state in zip(self.group_layers, self.policy_states):
            queries = torch.stack([self.step_queries[layer][-self.window:] for layer in layers])
            state.observe(request_id, queries, self.window)

    def use(self, policy: Policy | list[Policy] | tuple[Policy, ...]) -> None:
        """Evict by ``policy`` (one, or one per KV cache group) from the next request on: a chained
        turn's own budget. Attention-free policies (what a chain admits), the same group count."""
        policies = tuple(policy) if isinstance(policy, (list, tuple)) else (policy,)
        if len(policies) != len(self.group_layers) or any(p.query_window for p in policies) or self.window:
            raise ValueError("use: one attention-free policy per KV cache group, as the reference was built with")
        self.policies = self.unmeasured = policies
        self.policy = policies[0]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                 context_tokens: int | None = None, resume: bool = False, reconstruction=None) -> list[int]:
        return self.generate_with_top_logprobs(prompt_ids, max_new_tokens, eos_token_id,
                                               context_tokens=context_tokens, resume=resume,
                                               reconstruction=reconstruction)[0]

    def generate_with_top_logprobs(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                                   top: int = 3, context_tokens: int | None = None, resume: bool = False,
                                   reconstruction=None) -> tuple[list[int], list[list[list]]]:
        """Output ids and, per position, the ``top`` best ``[token, logprob]`` pairs (the engine
        runs' format, for the near-tie rule). ``context_tokens``: evict after the prompt's first
        ``context_tokens`` tokens, before the question (the rest) is computed; None: after the prompt.
        ``resume``: a chained turn, continuing the previous request's cache (the module's docstring)."""
        output, best, _ = self._decode(prompt_ids, max_new_tokens, eos_token_id, top, None, context_tokens, resume,
                                       reconstruction)
        return output, best

    def forced_logprobs(self, prompt_ids: list[int], forced: list[int], context_tokens: int | None = None) -> list[float]:
        """Teacher forcing: the model's log-probability of each of ``forced`` in turn, the cache
        evicted exactly as if the model had generated them (the engine's forced decoding)."""
        return self._decode(prompt_ids, len(forced), None, 1, forced, context_tokens)[2]

    @torch.no_grad()
    def _decode(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None, top: int,
                forced: list[int] | None, context_tokens: int | None = None, resume: bool = False,
                reconstruction=None) -> tuple[list[int], list[list[list]], list[float]]:
        from transformers import DynamicCache

        prompt_len = len(prompt_ids)
        evict_at = prompt_len if context_tokens is None else context_tokens  # where the prefill eviction runs
        if not 0 < evict_at <= prompt_len:
            raise ValueError(f"context_tokens={context_tokens} for a prompt of {prompt_len} tokens")
        if evict_at < prompt_len and any(p is not None and p.evicts and p.decode_eviction for p in self.policies):
            # A decode eviction would drop question tokens too: the setting compresses the context once.
            raise ValueError("context compression evicts the context only: the policy needs decode_eviction=False")
        if context_tokens is not None and any(
                p is not None and p.evicts and not p.decode_eviction and not p.whole_blocks for p in self.policies):
            # What the engine runs for compress=context (build_policy): a policy built otherwise would
            # keep a block rule's L mod B beside its budget, which the engine never does there.
            raise ValueError("context compression keeps whole blocks: build the policy for compress=context "
                             "(harness.eviction.settings.build_policy sets whole_blocks)")
        if resume:
            # The previous turn's cache, as it ended (the engine's chain entry of the same tokens)
            held = getattr(self, "chain_tokens", None)
            if held is None:
                raise ValueError("resume continues the previous request's cache: there is none")
            if list(prompt_ids[: len(held)]) != held:
                raise ValueError("a chained turn's prompt begins with the previous turn's prompt and output")
            if not len(held) < evict_at:
                raise ValueError(f"a chained turn computes at least one token before its boundary ({evict_at}); "
                                 f"the previous turn's cache holds {len(held)}")
            if self.window or self.schedule is not None or self.local_layers:
                raise ValueError("chained turns: attention-free policies at a fixed schedule only, on a model without "
                                 "sliding-window layers")
            cache, computed, evicted = self.cache, len(held), list(self.chain_evicted)
        else:
            cache, computed = DynamicCache(config=self.model.config), 0
            evicted = [0] * len(self.policies)  # per group
        self.chain_tokens = None
        self.policies, self.measured_budgets, self.prompt_tokens = self.unmeasured, None, prompt_len
        # One request at a time: each starts with empty policy state (per group: its layers' scales), a
        # chained turn too (the engine's request taking a chain entry has none either).
        self.policy_states = [PolicyState(scales=[float(self.attention_layers[layer].scaling) for layer in layers])
                              for layers in self.group_layers]
        inputs = torch.tensor([prompt_ids[computed:evict_at]], device=self.device)
        positions = torch.arange(computed, evict_at, device=self.device).unsqueeze(0)
        output, best, chosen = [], [], []
        while len(output) < max_new_tokens:
            # the first group's physical positions (with several groups each layer's own mask
            # replaces the one Hugging Face builds from them; the cache itself only appends)
            physical = computed - evicted[0]
            logits = self.model(
                input_ids=inputs,
                position_ids=positions,
                cache_position=torch.arange(physical, physical + inputs.shape[1], device=self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position is sampled; skip the prompt's logits
            ).logits
            before, computed = computed, computed + inputs.shape[1]
            self._observe("request")
            measuring = self.schedule.budget_schedule if self.schedule is not None and before < evict_at <= computed \
                else None
            if measuring == "attention":
                self._measure(cache, computed)
            if self.reconstructs and before < evict_at <= computed and any(evicted):
                raise ValueError("a reconstructing policy reconstructs the whole context: nothing may be evicted before it")
            scores = None
            if self.reconstructs and before < evict_at <= computed and self._prefill_due(evict_at):
                scores = self._reconstruct(cache, prompt_ids[:evict_at], reconstruction)
            if measuring == "kvzip":
                self._measure_kvzip(scores, evict_at, reconstruction)
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
        self.cache = cache  # the last request's cache as it ended, for a test to look into
        # what it holds, for a chained next turn: the prompt and every output but the last (never computed)
        self.chain_tokens, self.chain_evicted = list(prompt_ids) + output[:-1], evicted
        return output, best, chosen

    def _prefill_due(self, evict_at: int) -> bool:
        """Whether a reconstructing group's prefill eviction follows (the engine's worker asks the same)."""
        return any(p.reconstructs and p.needs_prefill_eviction(evict_at) for p in self.policies)

    def _reconstruct(self, cache, context: list[int], reconstruction) -> None:
        """KVzip's passes over the cache of the whole ``context`` (the module's docstring): each
        reconstructing group's ``[layers, heads, c]`` scores go to its policy state."""
        from policies.kvzip import chunk_scores, passes, with_sinks

        if reconstruction is None:
            raise ValueError(f"{self.policy.name} reconstructs the context: generate needs the request's reconstruction")
        score = next(p for p in self.policies if p.reconstructs).score
        c, layers = len(context), len(self.attention_layers)
        heads = cache.layers[0].keys.shape[1]
        scores = torch.zeros(layers, heads, c, device=self.device)
        for ids, start, end in passes(context, reconstruction.prefix_tokens, reconstruction.first,
                                      reconstruction.later, reconstruction.suffix, score.chunk_size, score.postfix):
            r = len(ids)
            self.step_queries.clear()
            # a sliding-window layer's cache as it was before the pass (the pass slides it on)
            held = {layer: (cache.layers[layer].keys, cache.layers[layer].values, cache.layers[layer].cumulative_length)
                    for layer in self.local_layers}
            self.model.model(input_ids=torch.tensor([ids], device=self.device),
                             position_ids=torch.arange(c, c + r, device=self.device).unsqueeze(0),
                             cache_position=torch.arange(c, c + r, device=self.device), past_key_values=cache,
                             use_cache=True)
            sinks = min(score.n_sink, start)
            for layer in range(layers):
                entry = cache.layers[layer]
                if layer in held:  # never scored: it never evicts
                    entry.keys, entry.values, entry.cumulative_length = held[layer]
                    continue
                keys = entry.keys[0].transpose(0, 1)  # [c + r, heads, dim]
                scale = float(self.attention_layers[layer].scaling)
                scores[layer, :, start:end] = chunk_scores(self.step_queries[layer], keys[:sinks], keys[start:end],
                                                           keys[c:], scale)
                entry.keys, entry.values = entry.keys[:, :, :c].contiguous(), entry.values[:, :, :c].contiguous()
        with_sinks(scores, score.n_sink)
        for policy, layers_of, state in zip(self.policies, self.group_layers, self.policy_states):
            if policy.reconstructs:
                state.scores["request"] = scores[list(layers_of)]
        return scores

    def _measure_kvzip(self, scores, evict_at: int, reconstruction) -> None:
        """The kvzip schedule's group budgets from every layer's reconstruction scores (None: no
        pass ran, the uniform budget holding the whole context), as the worker measures them; the
        groups' policies follow them."""
        block = self.policy.block_size
        settings = replace(self.schedule.at_context(evict_at), reconstruction=reconstruction
                           ).for_prompt(self.prompt_tokens, block)
        layers = len(self.attention_layers)
        parts = None if scores is None else [scores[group.start:group.stop] for group in self.group_layers]
        measured = kvzip_measured_settings(settings, parts, block, evict_at, layers, len(self.policies))
        self.policies = group_policies(measured, block, layers, len(self.policies))
        self.measured_budgets = measured.group_budgets

    def _measure(self, cache, tokens: int) -> None:
        """The attention schedule's group budgets from this pass's last queries and the cache (the
        pass reached the eviction point: nothing evicted yet); the groups' policies follow them."""
        block = self.policy.block_size
        window = min(ATTENTION_WINDOW, tokens)
        parts = []
        for layers, state in zip(self.group_layers, self.policy_states):
            queries = torch.stack([self.step_queries[layer][-window:] for layer in layers])
            view = DynamicCacheView(cache, block, layers)
            parts.append(spread_and_shift(view, list(range(-(-tokens // block))), tokens, queries, state.scales))
        measured = measured_settings(self.schedule.for_prompt(self.prompt_tokens, block), parts, block)
        self.policies = group_policies(measured, block, len(self.attention_layers), len(self.policies))
        self.measured_budgets = measured.group_budgets

    def _after_step(self, cache, evict_at: int, before: int, computed: int, evicted: list[int]) -> list[int]:
        """The evictions or query counting due, in each group, after a pass that took the request
        from ``before`` to ``computed`` logical tokens, with ``evict_at`` standing for the prompt's
        length: the engine's own step driver (``harness.eviction.step``) over this contiguous cache,
        whose "blocks" are its runs of ``block_size`` positions; returns each group's tokens
        evicted so far."""
        if self.policy is None:
            return evicted
        block = self.policies[0].block_size
        views = [DynamicCacheView(cache, block, layers) for layers in self.group_layers]
        blocks = [list(range(-(-(computed - gone) // block))) for gone in evicted]
        changed = evict_step(views, self.policy_states, [StepRequest("request", self.policies, blocks, evict_at,
                                                                     before, computed, tuple(evicted))])
        counts = list(evicted)
        for (_, group), eviction in sorted(changed.items()):
            physical = computed - counts[group]
            views[group].drop(eviction.dropped_blocks, physical - eviction.evicted_tokens)
            counts[group] += eviction.evicted_tokens
        return counts

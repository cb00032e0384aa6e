"""The measured schedules' measurements: each layer's share from one request's prompt.

Two schedules are measured per request, in the step that reaches its eviction point, before that
step's eviction: ``attention`` (CAKE's preferences, below) and ``kvzip`` (KVzip's global threshold
over the reconstruction scores the passes just left, ``kvzip_measured_settings``).

CAKE (Qin et al., ICLR 2025, arXiv 2503.12491) gives a layer more of the budget the more its
attention is spread over the tokens (H, the entropy) and the more it moves from query to query
(V, the variance): P = H^(1/tau1) x V^(1/tau2), read from the prompt's last queries
(``policies.budget_schedules``). Here that window is the last ``ATTENTION_WINDOW`` queries before
the eviction point (the prompt's end, or the context's), copied as the layers ran, and the keys are
the request's cache at that point, nothing evicted yet. It runs in the step that reaches the
eviction point, before that step's eviction, which then follows the measured budgets; the engine's
worker and the Hugging Face reference both call it, with their own views.

Under tensor parallelism each rank holds some of the heads: H and V are sums over heads, so the
ranks exchange their sums (one all-gather) and every rank derives the same preferences.
"""
from __future__ import annotations

import torch

from harness.eviction.kv_view import KVView
from harness.eviction.shards import SINGLE, HeadShards
from harness.eviction.settings import EvictionSettings
from policies.budget_schedules import kvzip_layer_counts, preference, window_spread_and_shift


def spread_and_shift(view: KVView, block_ids: list[int], tokens: int, window: torch.Tensor,
                     scales: list[float]) -> torch.Tensor:
    """``[layers, 2]`` float64: (H, V) of each of the view's layers, from the window's queries
    ``[layers, n, query_heads, head_dim]`` (the newest n of the request's ``tokens`` cached tokens)."""
    rows = []
    for layer in range(view.num_layers):
        keys, _ = view.read_layer(layer, block_ids, 0, tokens)
        rows.append(window_spread_and_shift(window[layer], keys, scales[layer]))
    return torch.tensor(rows, dtype=torch.float64)


def measured_settings(settings: EvictionSettings, parts: list[torch.Tensor], block_size: int,
                      shards: HeadShards = SINGLE, device: torch.device | str = "cpu") -> EvictionSettings:
    """The request's settings with its group budgets, from each group's ``spread_and_shift`` (its
    layers in order, group 0 first), summed over the tensor-parallel ranks' heads (gathered on the
    ranks' ``device``: NCCL takes CUDA tensors only)."""
    local = torch.cat(parts)  # [layers, 2]
    if shards.size > 1:
        gathered = shards.all_gather(local.to(device).contiguous()).cpu()
        local = gathered.reshape(shards.size, *local.shape).sum(dim=0)
    preferences = [preference(float(h), float(v)) for h, v in local.tolist()]
    return settings.with_preferences(preferences, block_size, local.shape[0], len(parts))


def kvzip_measured_settings(settings: EvictionSettings, scores: list[torch.Tensor] | None, block_size: int,
                            context: int, num_layers: int, groups: int) -> EvictionSettings:
    """The request's settings with the kvzip schedule's group budgets: each group's share the count
    of its layers' (KV head, token) scores among the top ``layers x heads x budget`` of every group's
    together (``policies.budget_schedules.kvzip_layer_counts``), none past the ``context``.
    ``scores``: each of the ``groups`` groups' ``[layers, kv_heads, context]`` reconstruction
    scores, group 0 first, every head's (the passes gather them across tensor-parallel ranks, so
    every rank derives the same budgets); None where no pass ran because the uniform budget already
    holds the whole context (every entry is then above any threshold: equal shares)."""
    if scores is None:
        counts = [1] * num_layers
    else:
        if len(scores) != groups or sum(part.shape[0] for part in scores) != num_layers:
            raise ValueError(f"scores of {[tuple(part.shape) for part in scores]} for {groups} groups of "
                             f"{num_layers} layers")
        counts = kvzip_layer_counts(scores, settings.budget)
    return settings.with_kept_counts(counts, block_size, num_layers, groups, context)

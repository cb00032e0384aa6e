"""Per-layer KV budgets: a request's budget B split over G groups of L/G consecutive layers.

The KV memory stays that of the uniform budget (group budgets x L/G sum to B x L), so the group
budgets, whole blocks, sum to G x B_blocks. A schedule only says how large each group's share is:
``uniform`` (equal: the engine as it is), ``pyramid`` (PyramidKV, Cai et al., arXiv 2406.02069:
lower layers get more), ``attention`` (CAKE's layer preferences, Qin et al., ICLR 2025, arXiv
2503.12491, measured on the prompt's last queries) or ``kvzip`` (KVzip's own allocation, Kim et al.,
arXiv 2505.23416: one threshold over every layer's and head's reconstruction scores, each layer's
share what it keeps above it, ``kvzip_layer_counts``). ``apportion`` turns shares into blocks between a
floor (``min_blocks``) and a cap (the sequence's length: blocks past it would hold nothing), in exact
arithmetic (``Fraction``) so that equal shares give equal budgets and a tie is a real tie.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

import torch

from policies.attention import Window, window_attention

SCHEDULES = ("uniform", "pyramid", "attention", "kvzip")
# CAKE's observation window: the prompt's last 32 queries (antgroup/cakekv's window_size, as SnapKV's).
ATTENTION_WINDOW = 32


def pyramid_layer_budgets(mean_budget: int, num_layers: int, beta: float = 20.0) -> list[Fraction]:
    """PyramidKV's budget of each layer, as kvpress's ``PyramidKVPress.get_layer_budget`` has it.

    From max_num = 2b - b/beta at layer 0 down to min_num = b/beta at the last layer in equal steps,
    so the mean stays b. beta >= 1 sets the slope: beta = 1 is flat (uniform), beta = 20 (kvpress's
    default) gives the top layer b/20 and the bottom one 1.95 b. kvpress caps
    max_num at the sequence length (less its window) and raises min_num to keep the mean; here the cap
    is ``apportion``'s general rule instead: capped groups give their surplus to the others in
    proportion to their shares, which keeps the total but bends the line.
    """
    if not math.isfinite(beta) or beta < 1:
        raise ValueError(f"beta must be a number >= 1 (1 is uniform), got {beta!r}")
    b = Fraction(mean_budget)
    low = b / Fraction(beta)
    high = 2 * b - low
    step = (high - low) / (num_layers - 1) if num_layers > 1 else Fraction(0)
    return [high - layer * step for layer in range(num_layers)]


def layer_preferences(attention_per_layer: Sequence[torch.Tensor], tau1: float = 1.0, tau2: float = 1.0) -> list[float]:
    """CAKE's preference P_l = H_l^(1/tau1) * V_l^(1/tau2) of each layer, from the prompt's attention.

    Each tensor is one layer's ``[heads, window, keys]`` attention of the prompt's last ``window``
    queries (rows sum to 1, causal zeros allowed). H (spatial dispersion) is the entropy, in nats, of
    each head's and query's row over the keys, summed: high when the layer reads many tokens. V
    (temporal shift) is the variance over the window's queries of each key's attention (unbiased),
    summed over heads and keys: high when what the layer reads moves. A layer whose every query
    reads one fixed sink has H = V = 0. This is how the authors' code measures both
    (antgroup/cakekv, ``cake/utils.py`` ``calculate_entropy`` and ``cake/model/modify_llama.py``;
    it passes the keys before the window, which is the caller's choice here). Only the layers'
    ratios matter to the allocation, so sums rather than means are harmless.

    The temperatures default to 1. CAKE tunes them per model and budget (antgroup/cakekv's
    experiments/LongBench/config/model2tau.json, e.g. Llama-3.1-8B at 1024: tau1 = 1.6, tau2 = 0.4).
    """
    return [preference(*spread_and_shift(attention), tau1, tau2) for attention in attention_per_layer]


def spread_and_shift(attention: torch.Tensor) -> tuple[float, float]:
    """One layer's (H, V) of ``layer_preferences``: the entropy of each head's and query's row over
    the keys, summed, and the variance over the queries of each key's attention, summed (both in
    float64). Sums over heads, so tensor-parallel ranks holding different heads add theirs."""
    if attention.dim() != 3:
        raise ValueError(f"attention must be [heads, window, keys], got {tuple(attention.shape)}")
    rows = attention.double()
    dispersion = max(0.0, -torch.xlogy(rows, rows).sum().item())  # 0 log 0 = 0: causal zeros
    # One query has no variance (the unbiased estimate would be 0/0).
    shift = rows.var(dim=1, correction=1).sum().item() if rows.shape[1] > 1 else 0.0
    return dispersion, shift


def preference(dispersion: float, shift: float, tau1: float = 1.0, tau2: float = 1.0) -> float:
    """CAKE's P = H^(1/tau1) x V^(1/tau2) of one layer."""
    if not (tau1 > 0 and tau2 > 0):
        raise ValueError(f"tau1 and tau2 must be positive, got {tau1!r} and {tau2!r}")
    return dispersion ** (1 / tau1) * shift ** (1 / tau2)


def window_spread_and_shift(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> tuple[float, float]:
    """(H, V) of one layer from the prompt's last queries ``[n, query_heads, head_dim]`` (post-RoPE)
    and its cached ``[tokens, kv_heads, head_dim]`` keys, the queries' own tokens last: each query's
    softmax over every key it sees, then, as CAKE's code slices it, the columns of the keys before
    the window (the window's own keys carry the causal zeros, which would be read as a shift)."""
    attention = window_attention(Window(queries, scale), keys)  # [kv_heads, group, n, tokens]
    kv_heads, group, n, tokens = attention.shape
    return spread_and_shift(attention.reshape(kv_heads * group, n, tokens)[..., : tokens - n])


def kvzip_layer_counts(scores: torch.Tensor | Sequence[torch.Tensor], kept_per_layer: int) -> list[Fraction]:
    """Each layer's share under KVzip's global threshold: how many of its (KV head, token) scores
    are among the ``layers x kept_per_layer`` best of all layers' and heads' together.

    ``scores``: ``[layers, kv_heads, tokens]`` (or a sequence of ``[layers_g, kv_heads, tokens]``
    parts, layer groups in order, joined along the layers), every layer over the same tokens. The
    uniform budget keeps ``kept_per_layer`` per layer and head, ``layers x heads x kept_per_layer``
    in all; KVzip's default (the authors' ``pair`` level, kvpress's ``KVzipPress`` with
    ``layerwise=False``, ``kvzip_press.py:384-387``) keeps the same total but the top-scoring
    entries of the whole cache, one threshold across layers and heads, so each layer keeps what
    scores above it. A layer's count is its entries strictly above the threshold (the k-th largest
    score) plus, of the entries equal to it, its part of those still needed, in proportion to how
    many it holds: exact (``Fraction``), so the counts sum to the total and a tie between layers
    stays a tie (no order among equal scores is invented). Counts beyond every entry keep all.
    """
    if not isinstance(kept_per_layer, int) or isinstance(kept_per_layer, bool) or kept_per_layer < 0:
        raise ValueError(f"kept_per_layer must be an integer >= 0, got {kept_per_layer!r}")
    joined = scores if isinstance(scores, torch.Tensor) else torch.cat(list(scores))
    if joined.dim() != 3 or joined.shape[0] < 1:
        raise ValueError(f"scores must be [layers, kv_heads, tokens], got {tuple(joined.shape)}")
    layers, heads, tokens = joined.shape
    kept = layers * heads * min(kept_per_layer, tokens)
    if kept == 0:
        return [Fraction(0)] * layers
    flat = joined.reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("scores must be finite")
    if kept == flat.numel():
        return [Fraction(heads * tokens)] * layers
    threshold = flat.kthvalue(flat.numel() - kept + 1).values  # the kept-th largest
    above = (joined > threshold).sum(dim=(1, 2)).tolist()
    tied = (joined == threshold).sum(dim=(1, 2)).tolist()
    needed, ties = kept - sum(above), sum(tied)  # 0 < needed <= ties: the threshold itself is kept
    return [above_l + Fraction(needed * tied_l, ties) for above_l, tied_l in zip(above, tied)]


def _targets(shares: list[Fraction], total: int, low: int, high: int) -> list[Fraction]:
    """clip(lam * share, low, high) per group, lam such that they sum to ``total`` (exactly)."""
    def at(lam: Fraction) -> list[Fraction]:
        return [min(max(lam * share, Fraction(low)), Fraction(high)) for share in shares]

    # The sum is piecewise linear and non-decreasing in lam, with kinks where a group meets a bound.
    kinks = sorted({Fraction(0)} | {bound / share for share in shares if share > 0 for bound in (low, high)})
    prev, sum_prev = kinks[0], sum(at(kinks[0]))
    if sum_prev >= total:
        return at(prev)
    for lam in kinks[1:]:
        sum_lam = sum(at(lam))
        if sum_lam >= total:
            return at(prev + (total - sum_prev) * (lam - prev) / (sum_lam - sum_prev))
        prev, sum_prev = lam, sum_lam
    raise AssertionError("apportion checks that the bounds can hold the total")


def apportion(shares: Sequence[float | Fraction], total: int, low: int = 0, high: int | None = None) -> list[int]:
    """``total`` whole blocks in proportion to ``shares``, each group between ``low`` and ``high``.

    A group past ``high`` keeps ``high`` and the surplus goes to the others in proportion to their
    shares (a group under ``low`` likewise takes from them). The result is rounded by largest
    remainders (Hamilton), so it sums to ``total`` exactly; equal remainders go to the earlier group.
    When ``high`` everywhere is less than ``total``, every group gets ``high`` and the sum is less:
    memory no layer can fill is not handed out. A floor above the cap becomes the cap.
    """
    count = len(shares)
    high = total if high is None else high
    low = min(low, high)
    if count * high <= total:
        return [high] * count
    if count * low > total:
        raise ValueError(f"{count} groups of at least {low} blocks need {count * low}, more than the {total} there are")
    exact = [Fraction(share) for share in shares]
    if any(share < 0 for share in exact):
        raise ValueError(f"shares must be non-negative, got {list(shares)}")
    if not any(exact):
        exact = [Fraction(1)] * count  # nothing prefers any group: no reason not to split evenly
    empty = [group for group, share in enumerate(exact) if share == 0]
    if high * (count - len(empty)) + low * len(empty) < total:
        # Every group with a share is capped: the groups without one split what is left evenly.
        blocks = [high] * count
        rest = apportion([1] * len(empty), total - high * (count - len(empty)), low, high)
        for group, extra in zip(empty, rest):
            blocks[group] = extra
        return blocks
    targets = _targets(exact, total, low, high)
    blocks = [math.floor(target) for target in targets]
    order = sorted(range(count), key=lambda group: (blocks[group] - targets[group], group))
    for group in order[: total - sum(blocks)]:
        blocks[group] += 1
    return blocks


def _whole(name: str, value: object, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def group_budgets(
    schedule: str, budget_tokens: int, num_layers: int, groups: int, block_size: int, *,
    beta: float = 20.0, preferences: Sequence[float] | None = None, counts: Sequence[int | Fraction] | None = None,
    min_blocks: int = 1, cap_tokens: int | None = None,
) -> tuple[int, ...]:
    """Each group's budget in tokens (multiples of ``block_size``), group 0 holding the first layers.

    ``budget_tokens`` is the uniform per-layer budget B; the group budgets in blocks sum to G x B
    blocks unless ``cap_tokens`` (the sequence's length; a partial last block counts whole) caps
    every group. ``beta`` shapes ``pyramid``; ``preferences`` (one per layer, ``layer_preferences``)
    drive ``attention``; ``counts`` (one per layer, ``kvzip_layer_counts``) drive ``kvzip``: a
    group's share is its layers' kept entries, so its budget per layer and head is their mean over
    its layers and heads (the heads of a layer stay equal: one paged slot holds every head's token),
    and the groups' budgets still sum to G x B (equal groups of layers).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown budget schedule {schedule!r}: the schedules are {', '.join(SCHEDULES)}")
    _whole("block_size", block_size, 1)
    if _whole("budget_tokens", budget_tokens, block_size) % block_size:
        raise ValueError(f"budget_tokens={budget_tokens} is not a whole number of {block_size}-token blocks")
    if _whole("num_layers", num_layers, 1) % _whole("groups", groups, 1):
        raise ValueError(f"groups={groups} must divide num_layers={num_layers} (equal groups of layers)")
    budget_blocks = budget_tokens // block_size
    if _whole("min_blocks", min_blocks, 0) > budget_blocks:
        raise ValueError(
            f"min_blocks={min_blocks} is more than the uniform budget of {budget_blocks} blocks, so the groups "
            f"cannot all get it within the total"
        )
    if schedule == "uniform":
        layer_shares: Sequence[float | Fraction] = [1] * num_layers
    elif schedule == "pyramid":
        layer_shares = pyramid_layer_budgets(budget_tokens, num_layers, beta)
    elif schedule == "kvzip":
        if counts is None or len(counts) != num_layers:
            raise ValueError(f"the kvzip schedule needs one kept count per layer ({num_layers}), got {counts}")
        if not all(Fraction(count) >= 0 for count in counts):
            raise ValueError(f"kept counts must be non-negative, got {list(counts)}")
        layer_shares = list(counts)
    else:
        if preferences is None or len(preferences) != num_layers:
            raise ValueError(f"the attention schedule needs one preference per layer ({num_layers}), got {preferences}")
        if not all(math.isfinite(p) and p >= 0 for p in preferences):
            raise ValueError(f"preferences must be finite and non-negative, got {list(preferences)}")
        layer_shares = list(preferences)
    size = num_layers // groups
    shares = [sum(map(Fraction, layer_shares[g * size : (g + 1) * size])) for g in range(groups)]
    cap_blocks = None if cap_tokens is None else -(-_whole("cap_tokens", cap_tokens, 1) // block_size)
    blocks = apportion(shares, groups * budget_blocks, min_blocks, cap_blocks)
    return tuple(group_blocks * block_size for group_blocks in blocks)

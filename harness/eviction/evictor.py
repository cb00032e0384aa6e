"""Carries out one policy decision on one request's paged KV: the worker-side mechanism.

It scores the request's tokens through a backend view, asks the policy, and either drops a block
(decode, block policies: nothing moves) or compacts the kept tokens into the request's first
slots (prefill, and decode for token policies) so that whole tail blocks become free. It returns
which of the request's blocks to release; the scheduler side returns them to vLLM's pool.

Memory stays flat in the model's size: K/V are read one layer at a time (one layer of one request,
in the cache's dtype), never the whole request for every layer. A policy whose scores are fixed
once a token is written (``static_scores``) keeps them per request between evictions
(``PolicyState``): a decode eviction then scores only the tokens written since the last one, a block
of them, whatever the context length. An attention-aware policy scores with the request's query
window (``PolicyState.windows``, filled by the engine as the attention layers run); one whose scores
accumulate (H2O) adds what each query paid every cached token to the totals the state keeps, which
follow their tokens through compaction and block drops. Queries are counted whether or not an
eviction is due (``count_due``): the prompt's last window once the prompt is computed, decode
queries whenever the window holds ``window`` uncounted ones, and the rest at an eviction. Counting
late is exact: until the next eviction the cache only grows, and the window is causal. Nothing here imports vLLM,
so the Hugging Face reference engine runs the same code path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from harness.eviction.kv_view import KVView
from policies import BlockPolicy, Policy, TokenPolicy
from policies.attention import Window
from harness.eviction.state import MissingWindowError, PolicyState

Phase = Literal["prefill", "decode"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Eviction:
    phase: Phase
    # The request's new block list, as positions in its old one (which may end with blocks
    # allocated as copy targets); every position not named here is released.
    kept_blocks: tuple[int, ...]
    held_blocks: int                 # length of the old block list
    evicted_tokens: int              # physical length before minus after
    copied_tokens: int               # token slots rewritten by compaction (all layers and heads)
    seconds: float = 0.0             # wall time of this eviction (set by the engine)

    @property
    def dropped_blocks(self) -> tuple[int, ...]:
        kept = set(self.kept_blocks)
        return tuple(p for p in range(self.held_blocks) if p not in kept)

    @property
    def changes_blocks(self) -> bool:
        return self.kept_blocks != tuple(range(self.held_blocks))


def phase_due(policy: Policy, prompt_len: int, computed_before: int, computed_after: int, evicted: int) -> Phase | None:
    """Whether this step ends with an eviction, from the request's logical counts.

    Prefill eviction follows the step that completes the prompt (attention ran over all of it);
    decode eviction follows a generation step after which the newest block is full past budget.
    """
    if not policy.evicts:
        return None
    if computed_before < prompt_len <= computed_after:
        return "prefill" if policy.needs_prefill_eviction(prompt_len) else None
    if computed_before >= prompt_len and policy.needs_decode_eviction(computed_after - evicted):
        return "decode"
    return None


def count_due(policy: Policy, prompt_len: int, computed_before: int, computed_after: int,
              state: PolicyState | None, request_id: str) -> bool:
    """Whether an accumulating policy must count the request's uncounted queries after this step:
    the step completed the prompt (its last window of queries is counted then, eviction or not), or
    in decode the window holds nothing but uncounted queries (one more step would push one out)."""
    if not policy.accumulates or state is None or request_id not in state.windows:
        return False
    fresh = state.windows[request_id].fresh
    if computed_before < prompt_len <= computed_after:
        return fresh > 0
    return computed_before >= prompt_len and fresh >= policy.query_window


def count_queries(policy: Policy, view: KVView, block_ids: list[int], tokens: int, state: PolicyState,
                  request_id: str) -> torch.Tensor:
    """Fold what the window's uncounted queries say of each of the ``tokens`` cached slots into the
    request's state (H2O: the attention they paid, added to the totals); returns the state."""
    totals = state.scores.get(request_id)
    if totals is not None and totals.shape[-1] > tokens:
        raise RuntimeError(f"kept totals for {totals.shape[-1]} tokens, but the request holds {tokens}")
    windows = state.layer_windows(request_id, fresh_only=True)  # refuses a request with no captured queries
    fresh = state.windows[request_id].fresh
    if not fresh and totals is not None and totals.shape[-1] == tokens:
        return totals
    counted = score_slots(policy, view, block_ids, 0, tokens, windows)
    state.windows[request_id].fresh = 0
    state.scores[request_id] = policy.score.accumulate(totals, counted, fresh)
    return state.scores[request_id]


def score_slots(policy: Policy, view: KVView, block_ids: list[int], start: int, end: int,
                windows: list[Window] | None = None) -> torch.Tensor:
    """``[scored layers, heads, end - start]`` scores of slots ``[start, end)``, a layer at a time
    (an attention-aware policy also gets each layer's query window)."""
    rows = []
    for layer in policy.scored_layers(view.num_layers):
        keys, values = view.read_layer(layer, block_ids, start, end)
        if windows is None:
            rows.append(policy.layer_scores(keys, values))
        else:
            rows.append(policy.layer_scores(keys, values, windows[layer]))
    return torch.stack(rows)


def current_scores(policy: Policy, view: KVView, block_ids: list[int], tokens: int, phase: Phase,
                   cached: torch.Tensor | None, windows: list[Window] | None = None) -> torch.Tensor | None:
    """The scores a decision needs: all tokens' at prefill (the cache starts afresh), for a
    static-score policy in decode the cached ones plus those of the tokens written since
    (an accumulating policy's totals come from ``count_queries``)."""
    if not policy.needs_kv:
        return None
    if cached is not None and cached.shape[-1] > tokens:
        raise RuntimeError(f"kept scores for {cached.shape[-1]} tokens, but the request holds {tokens}")
    if phase == "decode" and policy.static_scores and cached is not None:
        fresh = score_slots(policy, view, block_ids, cached.shape[-1], tokens)
        return torch.cat([cached, policy.cached_form(fresh)], dim=-1)
    return score_slots(policy, view, block_ids, 0, tokens, windows)


def compact(view: KVView, block_ids: list[int], tokens: int, kept: torch.Tensor,
            targets_table: list[int] | None = None, rewrite_from: int | None = None) -> int:
    """Pack ``kept`` ([layers, heads, n] source indices into the slots of ``block_ids``) into slots
    0..n-1 of ``targets_table`` (default: the same blocks), one layer at a time; returns the slots
    written.

    Slots before the first index that moves keep their contents, unless ``rewrite_from`` says
    the target blocks differ from there on (copy targets); from that slot on each layer's sources
    (all at or after it, indices being sorted) are read first and then written, so overlapping
    sources and destinations are safe.
    """
    kept = kept.to(view.device)
    count = kept.shape[-1]
    identity = torch.arange(count, device=kept.device)
    moved = (kept != identity).flatten(0, 1).any(dim=0)
    starts = [int(moved.nonzero()[0])] if moved.any() else []
    if rewrite_from is not None and rewrite_from < count:
        starts.append(rewrite_from)
    if not starts:
        return 0
    first = min(starts)
    targets = torch.arange(first, count, device=kept.device)
    table = torch.tensor(targets_table or block_ids, dtype=torch.long, device=kept.device)
    blocks, offsets = table[targets // view.block_size], targets % view.block_size
    for layer in range(view.num_layers):
        keys, values = view.read_layer(layer, block_ids, first, tokens)
        index = (kept[layer, :, first:] - first).T.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        view.write_layer(layer, blocks, offsets, torch.gather(keys, 0, index), torch.gather(values, 0, index))
    return count - first


def kept_scores(policy: Policy, scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The cached scores after compaction: each slot's score follows its token (accumulated
    totals stay per layer and head; static scores take the policy's cached form)."""
    layers = policy.scored_layers(kept.shape[0])
    if scores.shape[0] == len(layers) and scores.shape[1] == kept.shape[1]:
        followed = scores.gather(-1, kept[layers].to(scores.device))
        return followed if policy.accumulates else policy.cached_form(followed)
    return scores.gather(-1, kept[:1, :1].to(scores.device))  # a reduced form under a shared keep set


def evict(policy: Policy, view: KVView, block_ids: list[int], tokens: int, phase: Phase,
          state: PolicyState | None = None, request_id: str = "", copy_targets: tuple[int, ...] = ()) -> Eviction:
    """Apply the policy to a request holding ``tokens`` physical tokens in ``block_ids``.

    With a ``state``, a static-score policy's scores are cached there under ``request_id``.
    ``copy_targets``: positions of blocks that must not be written (registered in the prefix
    cache or shared); the request's token blocks are then followed in ``block_ids`` by as many
    blocks of its own, which compaction writes instead, in that order."""
    block_size = policy.block_size
    source = block_ids[: cdiv(tokens, block_size)]
    held = len(source) + len(copy_targets)
    if len(block_ids) < held:
        raise ValueError(f"{len(copy_targets)} copy target(s) but only {len(block_ids) - len(source)} spare block(s)")
    cached = state.scores.get(request_id) if state is not None else None
    windows = None
    if policy.query_window and state is None:
        raise MissingWindowError(f"{policy.name} scores by attention: it needs the request's query window")
    if policy.accumulates:
        scores = count_queries(policy, view, source, tokens, state, request_id)
    else:
        if policy.query_window:
            windows = state.layer_windows(request_id, fresh_only=False)
            state.windows[request_id].fresh = 0
        scores = current_scores(policy, view, source, tokens, phase, cached, windows)
    remember = state is not None and (policy.static_scores or policy.accumulates) and scores is not None

    if phase == "decode" and isinstance(policy, BlockPolicy):
        if copy_targets:
            raise ValueError("a block eviction writes nothing: it takes no copy targets")
        victim = policy.select_victim(scores, tokens)
        if remember:
            if cached is None and not policy.accumulates:  # totals stay per layer and head
                scores = policy.cached_form(scores)
            state.scores[request_id] = torch.cat(
                [scores[..., : victim * block_size], scores[..., (victim + 1) * block_size :]], dim=-1)
        return Eviction(phase, tuple(p for p in range(held) if p != victim), held, block_size, 0)

    layers, heads = view.num_layers, view.num_heads
    if phase == "prefill":
        kept = policy.select_prefill(scores, tokens, layers, heads)
    elif isinstance(policy, TokenPolicy):
        kept = policy.select_decode(scores, tokens, layers, heads)
    else:
        raise TypeError(f"{type(policy).__name__} cannot evict in {phase}")
    positions = list(range(len(source)))  # where each target block sits in block_ids
    for extra, target in enumerate(copy_targets):
        positions[target] = len(source) + extra
    copied = compact(view, source, tokens, kept, [block_ids[p] for p in positions],
                     min(copy_targets) * block_size if copy_targets else None)
    if remember:
        state.scores[request_id] = kept_scores(policy, scores, kept)
    remaining = kept.shape[-1]
    return Eviction(phase, tuple(positions[: cdiv(remaining, block_size)]), held, tokens - remaining, copied)

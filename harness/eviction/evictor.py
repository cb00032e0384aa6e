"""Carries out policy decisions on requests' paged KV: the worker-side mechanism.

For each request due (``Due``) it scores the tokens through a view, asks the policy, and either
drops a block (decode, block policies: nothing moves) or compacts the kept tokens into the
request's first slots (prefill, and decode for token policies) so that whole tail blocks become
free. It returns which of each request's blocks to release; the scheduler side returns them to
vLLM's pool. The requests due in one step are handled together (``evict_all``), in groups whose
K/V of one layer fit the view's ``joint_read_bytes``: a group's scoring reads each layer with one
gather, and its compactions each layer with one gather and one scatter.

Memory stays flat in the model's size: K/V are read one layer at a time (in the cache's dtype),
never a request's every layer at once. A policy whose scores are fixed once a token is written
(``static_scores``) keeps them per request between evictions (``PolicyState``): a decode eviction
then scores only the tokens written since the last one, a block of them, whatever the context
length. An attention-aware policy scores with the request's query window
(``PolicyState.windows``, filled by the engine as the attention layers run); one whose scores
accumulate (H2O) adds what each query paid every cached token to the totals the state keeps, which
follow their tokens through compaction and block drops. Queries are counted whether or not an
eviction is due (``count_due``): the prompt's last window once the prompt is computed, decode
queries whenever the window holds ``window`` uncounted ones, and the rest at an eviction. Counting
late is exact: until the next eviction the cache only grows, and the window is causal. Under
tensor parallelism (``shards``) a rank scores its own KV heads, the ranks exchange those scores,
and each decides on every head and compacts its own (``harness.eviction.shards``). Nothing here
imports vLLM, so the Hugging Face reference engine runs the same code path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from harness.eviction.shards import SINGLE, HeadShards
from harness.eviction.kv_view import KVView
from policies import BlockPolicy, Policy, TokenPolicy
from policies.attention import Window
from harness.eviction.state import MissingWindowError, PolicyState

Phase = Literal["prefill", "decode"]


class PolicyFailure(RuntimeError):
    """A policy's own code failed on one request: its score or selection raised, or its score was
    not ``[kv_heads, tokens]`` finite numbers. The engine ends that request with this message and
    serves the others (``evict_all``'s ``failures``); the message names the policy."""

    def __init__(self, policy: str, what: str):
        super().__init__(f"policy {policy} failed: {what}")
        self.policy = policy


NOT_FINITE = "its score returned NaN or infinite values"


def checked_shape(policy: Policy, scores, keys: torch.Tensor) -> torch.Tensor:
    """A layer's scores if they are ``[kv_heads, tokens]`` of the K/V it was given, else
    ``PolicyFailure`` saying what is wrong. Shapes only: no device synchronisation."""
    expected = (keys.shape[1], keys.shape[0])
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise PolicyFailure(policy.name, f"its score returned {shape}; a score returns [kv_heads, tokens] = "
                                         f"{list(expected)} for K/V of {keys.shape[0]} tokens and {keys.shape[1]} heads")
    return scores


def checked_scores(policy: Policy, scores, keys: torch.Tensor) -> torch.Tensor:
    """A layer's scores as the selections need them, or ``PolicyFailure`` saying what is wrong:
    ``[kv_heads, tokens]`` of the K/V it was given (``checked_shape``), finite (a NaN would
    silently decide by index). Reads the device once: for one layer alone (admission's try);
    ``score_together`` checks shapes per layer and finiteness once per step."""
    checked_shape(policy, scores, keys)
    if not torch.isfinite(scores).all():
        raise PolicyFailure(policy.name, NOT_FINITE)
    return scores


def not_finite(policy: Policy, scores: torch.Tensor, layers: list[int]) -> PolicyFailure | None:
    """A job's failure if its scores ``[scored layers, heads, tokens]`` (``layers`` the layer of
    each row) hold a NaN or an infinity, naming the first such layer; None if all are finite. For
    a failure's message or a row already known to fail: it reads the device."""
    finite = torch.isfinite(scores).flatten(1).all(dim=1)
    if bool(finite.all()):
        return None
    return PolicyFailure(policy.name, f"{NOT_FINITE}, first in layer {layers[int((~finite).nonzero()[0])]}")


def as_failure(policy: Policy, error: Exception) -> PolicyFailure:
    return error if isinstance(error, PolicyFailure) else PolicyFailure(policy.name, f"{type(error).__name__}: {error}")


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

    Prefill eviction follows the step that completes the prompt (attention ran over all of it),
    where the tokens held there (``prompt_len - evicted``: the prompt, or under ``chain`` the
    previous turn's kept cache and the new tokens) exceed the budget; decode eviction follows a
    generation step after which the newest block is full past budget.
    """
    if not policy.evicts:
        return None
    if computed_before < prompt_len <= computed_after:
        return "prefill" if policy.needs_prefill_eviction(prompt_len - evicted) else None
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
                  request_id: str, shards: HeadShards = SINGLE) -> torch.Tensor:
    """Fold what the window's uncounted queries say of each of the ``tokens`` cached slots into the
    request's state (H2O: the attention they paid, added to the totals); returns the state."""
    job = counting_job(policy, block_ids, tokens, state, request_id)
    if job is not None:
        (counted,) = shards.gather_heads(score_together(view, [job]))
        fold_counted(policy, state, request_id, counted)
    return state.scores[request_id]


@dataclass
class ScoreJob:
    """One request's slots ``[start, end)`` to score with its policy (and its query windows)."""

    policy: Policy
    block_ids: list[int]
    start: int
    end: int
    windows: list[Window] | None = None


def counting_job(policy: Policy, block_ids: list[int], tokens: int, state: PolicyState, request_id: str
                 ) -> ScoreJob | None:
    """The scoring an accumulating policy's uncounted queries need, or None when all are counted."""
    totals = state.scores.get(request_id)
    if totals is not None and totals.shape[-1] > tokens:
        raise RuntimeError(f"kept totals for {totals.shape[-1]} tokens, but the request holds {tokens}")
    windows = state.layer_windows(request_id, fresh_only=True)  # refuses a request with no captured queries
    if not state.windows[request_id].fresh and totals is not None and totals.shape[-1] == tokens:
        return None
    return ScoreJob(policy, block_ids, 0, tokens, windows)


def fold_counted(policy: Policy, state: PolicyState, request_id: str, counted: torch.Tensor) -> None:
    window = state.windows[request_id]
    state.scores[request_id] = policy.score.accumulate(state.scores.get(request_id), counted, window.fresh)
    window.fresh = 0


def joint_reads(view: KVView, lengths: list[int]) -> list[list[int]]:
    """Consecutive runs grouped so that one layer's joint read of a group stays within the view's
    ``joint_read_bytes`` (a run longer than that reads alone)."""
    limit = view.joint_read_bytes
    groups, size = [], 0
    for index, length in enumerate(lengths):
        need = length * view.token_bytes
        if not groups or (limit is not None and size + need > limit):
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += need
    return groups


def score_together(view: KVView, jobs: list[ScoreJob], failed: dict[int, PolicyFailure] | None = None
                   ) -> list[torch.Tensor]:
    """Each job's ``[scored layers, heads, end - start]`` scores. A layer at a time, every job's
    slots of that layer are read with one gather (the slots are located once for all layers), and
    each job's policy scores its part (an attention-aware one with that layer's query window).

    A job whose policy fails (``PolicyFailure``) raises, or, given ``failed``, is recorded there by
    its index and scored no further (zeros stand in, so the jobs' shapes stay as every rank expects).
    Shapes are checked per layer; finiteness once, for every job together, after the last layer."""
    if not jobs:
        return []
    slots = view.locate([(job.block_ids, job.start, job.end) for job in jobs])
    scored = [set(job.policy.scored_layers(view.num_layers)) for job in jobs]
    rows: list[list[torch.Tensor]] = [[] for _ in jobs]
    for layer in range(view.num_layers):
        users = [index for index, layers in enumerate(scored) if layer in layers]
        if not users:
            continue
        # Values only when a job's score reads them (attention scores read keys alone).
        keys, values = view.read(layer, slots, values=any(jobs[index].policy.score.reads_values for index in users))
        for index in users:
            job, part = jobs[index], slots.parts[index]
            job_keys = keys[part]
            if failed is not None and index in failed:
                rows[index].append(torch.zeros(job_keys.shape[1], job_keys.shape[0], device=job_keys.device))
                continue
            job_values = values[part] if job.policy.score.reads_values else None
            try:
                window = () if job.windows is None else (job.windows[layer],)
                rows[index].append(checked_shape(job.policy, job.policy.layer_scores(job_keys, job_values, *window),
                                                 job_keys))
            except Exception as error:  # the policy's own code: its request fails, not the step
                failure = as_failure(job.policy, error)
                if rows[index]:  # a NaN in an earlier layer came first: that is its failure
                    failure = not_finite(job.policy, torch.stack(rows[index]), sorted(scored[index])) or failure
                if failed is None:
                    raise failure from error
                failed[index] = failure
                rows[index].append(torch.zeros(job_keys.shape[1], job_keys.shape[0], device=job_keys.device))
    stacked = [torch.stack(row) for row in rows]
    # Finite, checked once for the whole step: one flag per job, read from the device together
    # (per layer it was a synchronisation per layer and job on a GPU).
    checking = [index for index in range(len(jobs)) if failed is None or index not in failed]
    if checking:
        finite = torch.stack([torch.isfinite(stacked[index]).all() for index in checking]).tolist()
        for index, ok in zip(checking, finite):
            if ok:
                continue
            failure = not_finite(jobs[index].policy, stacked[index], sorted(scored[index]))
            if failed is None:
                raise failure
            failed[index] = failure
            stacked[index] = torch.zeros_like(stacked[index])
    return stacked


@dataclass
class Move:
    """One request's compaction: ``kept`` ``[layers, heads, n]`` source indices into the slots of
    ``block_ids`` move to slots 0..n-1 of ``targets``; slots before ``first`` keep their contents."""

    block_ids: list[int]
    tokens: int
    kept: torch.Tensor
    targets: list[int]
    first: int

    @property
    def written(self) -> int:
        return self.kept.shape[-1] - self.first


def plan_move(block_ids: list[int], tokens: int, kept: torch.Tensor, targets_table: list[int] | None = None,
              rewrite_from: int | None = None) -> Move | None:
    """Where a compaction starts: at the first index that moves, or earlier when ``rewrite_from``
    says the target blocks differ from there on (copy targets); None when nothing moves."""
    count = kept.shape[-1]
    identity = torch.arange(count, device=kept.device)
    moved = (kept != identity).flatten(0, 1).any(dim=0)
    starts = [int(moved.nonzero()[0])] if moved.any() else []
    if rewrite_from is not None and rewrite_from < count:
        starts.append(rewrite_from)
    if not starts:
        return None
    return Move(block_ids, tokens, kept, targets_table or block_ids, min(starts))


def compact_together(view: KVView, moves: list[Move]) -> None:
    """Carry out every move, a layer at a time with one read and one write for all of them.

    Each move's sources lie at or after its ``first`` slot (indices are sorted), and a layer's
    reads all happen before its writes, so sources and destinations may overlap (and a block
    shared read-only between requests is read before anything is written)."""
    if not moves:
        return
    device = view.device
    sources = view.locate([(move.block_ids, move.first, move.tokens) for move in moves])
    target_blocks, target_offsets, gathers = [], [], []
    for move, part in zip(moves, sources.parts):
        table = torch.tensor(move.targets, dtype=torch.long, device=device)
        slots = torch.arange(move.first, move.kept.shape[-1], device=device)
        target_blocks.append(table[slots // view.block_size])
        target_offsets.append(slots % view.block_size)
        # [layers, written, heads]: each written slot's source row in the layer's joint read
        gathers.append((move.kept[:, :, move.first:].to(device) - move.first + part.start).transpose(1, 2))
    blocks, offsets = torch.cat(target_blocks), torch.cat(target_offsets)
    index = torch.cat(gathers, dim=1)
    # As rows of the read flattened to [rows * heads, dim]: picking whole rows (index_select) ran
    # 10x faster on CPU than torch.gather with the index expanded over head_dim.
    heads = index.shape[-1]
    flat = (index * heads + torch.arange(heads, device=device)).flatten(1)
    for layer in range(view.num_layers):
        keys, values = view.read(layer, sources)
        dim = keys.shape[-1]
        pick = lambda rows: rows.reshape(-1, dim).index_select(0, flat[layer]).view(-1, heads, dim)
        view.write_layer(layer, blocks, offsets, pick(keys), pick(values))


def kept_scores(policy: Policy, scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The cached scores after compaction: each slot's score follows its token (accumulated
    totals stay per layer and head; static scores take the policy's cached form)."""
    layers = policy.scored_layers(kept.shape[0])
    if scores.shape[0] == len(layers) and scores.shape[1] == kept.shape[1]:
        followed = scores.gather(-1, kept[layers].to(scores.device))
        return followed if policy.accumulates else policy.cached_form(followed)
    return scores.gather(-1, kept[:1, :1].to(scores.device))  # a reduced form under a shared keep set


@dataclass
class Due:
    """A request whose eviction is due this step: ``tokens`` physical tokens in ``block_ids``, then
    one block of its own per ``copy_targets`` position (blocks that must not be written: registered
    in the prefix cache or shared), which compaction writes instead, in that order."""

    request_id: str
    policy: Policy
    block_ids: list[int]
    tokens: int
    phase: Phase
    copy_targets: tuple[int, ...] = ()

    @property
    def source(self) -> list[int]:
        return self.block_ids[: cdiv(self.tokens, self.policy.block_size)]

    @property
    def held(self) -> int:
        return len(self.source) + len(self.copy_targets)


def compaction_positions(source_blocks: int, copy_targets: tuple[int, ...]) -> list[int]:
    """Where each block a compaction writes sits in the request's held list (its ``source_blocks``
    own blocks, then one block per copy target, which stands in for the block at that position):
    the kept tokens fill them in this order, so the first ``cdiv(kept, block_size)`` are kept."""
    positions = list(range(source_blocks))
    for extra, target in enumerate(copy_targets):
        positions[target] = source_blocks + extra
    return positions


def kept_tokens(policy: Policy, phase: Phase, tokens: int) -> int:
    """How many tokens a compaction of ``tokens`` keeps: ``prefill_keep_count`` after prefill, the
    budget in decode (what ``select_prefill`` / ``select_decode`` return for a token policy)."""
    return policy.prefill_keep_count(tokens) if phase == "prefill" else policy.budget


def evict_all(view: KVView, dues: list[Due], state: PolicyState | None = None,
              shards: HeadShards = SINGLE, failures: dict[str, PolicyFailure] | None = None) -> dict[str, Eviction]:
    """Carry out every eviction due in a step, together: in groups whose K/V of one layer fit the
    view's ``joint_read_bytes``, a group's scoring reads each layer with one gather, and its
    compactions each layer with one gather and one scatter. Grouping also bounds the step's
    scratch (a group's scores and keep sets live until its compaction). Returns ``{request_id:
    Eviction}``. With a ``state``, a static-score policy's scores are cached there, an
    accumulating one's totals kept, and attention windows read. Under tensor parallelism
    (``shards``), every rank must call this with the same dues, and checks that all decided alike.

    A policy that fails on a request (``PolicyFailure``: its score or selection raised, or scored
    wrongly) raises, or, given ``failures``, fails that request alone: it is named there, nothing of
    its K/V is written, and the other requests are evicted as if it had not been due."""
    evictions, kept_sets = {}, []
    for group in joint_reads(view, [due.tokens for due in dues]):
        evictions.update(evict_group(view, [dues[index] for index in group], state, shards, kept_sets, failures))
    shards.check_agree([(rid, e.kept_blocks, e.evicted_tokens, e.copied_tokens) for rid, e in evictions.items()],
                       kept_sets, view.device)
    return evictions


def evict_group(view: KVView, dues: list[Due], state: PolicyState | None, shards: HeadShards = SINGLE,
                kept_sets: list | None = None, failures: dict[str, PolicyFailure] | None = None
                ) -> dict[str, Eviction]:
    jobs, cached = [], {}
    for due in dues:
        if len(due.block_ids) < due.held:
            raise ValueError(f"{len(due.copy_targets)} copy target(s) but only "
                             f"{len(due.block_ids) - len(due.source)} spare block(s)")
        policy, rid = due.policy, due.request_id
        if policy.query_window and state is None:
            raise MissingWindowError(f"{policy.name} scores by attention: it needs the request's query window")
        cached[rid] = state.scores.get(rid) if state is not None else None
        jobs.append(scoring_job(due, state, cached[rid]))
    # Every rank holds the scores of every head from here on (a single worker's scores).
    scoring = [(due, job) for due, job in zip(dues, jobs) if job is not None]
    failed: dict[int, PolicyFailure] | None = None if failures is None else {}
    scored = iter(shards.gather_heads(score_together(view, [job for _, job in scoring], failed)))
    for index, failure in (failed or {}).items():
        failures[scoring[index][0].request_id] = failure

    evictions, moves, remembered = {}, [], []
    for due, job in zip(dues, jobs):
        policy, rid = due.policy, due.request_id
        fresh = next(scored) if job is not None else None
        if failures is not None and rid in failures:
            continue  # its policy failed: nothing of it is written
        if due.phase == "decode" and isinstance(policy, BlockPolicy) and due.copy_targets:
            raise ValueError("a block eviction writes nothing: it takes no copy targets")
        try:
            move, eviction, remember_as = decide(view, due, state, cached[rid], fresh, shards, kept_sets)
        except Exception as error:  # the policy's selection: its request fails, not the step
            if failures is None:
                raise as_failure(policy, error) from error
            failures[rid] = as_failure(policy, error)
            continue
        evictions[rid] = eviction
        if move is not None:
            moves.append(move)
        if remember_as is not None:
            remembered.append(remember_as)
    compact_together(view, moves)
    for rid, policy, scores, kept in remembered:
        state.scores[rid] = kept_scores(policy, scores, kept)
    return evictions


def decide(view: KVView, due: Due, state: PolicyState | None, cached: torch.Tensor | None,
           fresh: torch.Tensor | None, shards: HeadShards, kept_sets: list | None):
    """One due request's decision from its scores: ``(move, eviction, remembered)``, the
    compaction to carry out (None: nothing moves), what the request's block list becomes, and
    the scores to keep for it once compaction is done (None: none)."""
    policy, rid, tokens, block_size = due.policy, due.request_id, due.tokens, due.policy.block_size
    scores = decision_scores(due, state, cached, fresh)
    remember = state is not None and (policy.static_scores or policy.accumulates) and scores is not None
    held = due.held

    if due.phase == "decode" and isinstance(policy, BlockPolicy):
        victim = policy.select_victim(scores, tokens)
        if remember:
            if cached is None and not policy.accumulates:  # totals stay per layer and head
                scores = policy.cached_form(scores)
            state.scores[rid] = torch.cat(
                [scores[..., : victim * block_size], scores[..., (victim + 1) * block_size :]], dim=-1)
        return None, Eviction(due.phase, tuple(p for p in range(held) if p != victim), held, block_size, 0), None

    layers, heads = view.num_layers, view.num_heads * shards.size
    if due.phase == "prefill":
        kept = policy.select_prefill(scores, tokens, layers, heads)
    elif isinstance(policy, TokenPolicy):
        kept = policy.select_decode(scores, tokens, layers, heads)
    else:
        raise TypeError(f"{type(policy).__name__} cannot evict in {due.phase}")
    source = due.source
    positions = compaction_positions(len(source), due.copy_targets)
    if kept_sets is not None and shards.size > 1:
        kept_sets.append(kept)
    # Where compaction starts is decided on every head, so that all ranks rewrite the same slots.
    move = plan_move(source, tokens, kept.to(view.device), [due.block_ids[p] for p in positions],
                     min(due.copy_targets) * block_size if due.copy_targets else None)
    if move is not None:
        move = dataclasses.replace(move, kept=move.kept[:, shards.local(view.num_heads)])
    remaining = kept.shape[-1]
    eviction = Eviction(due.phase, tuple(positions[: cdiv(remaining, block_size)]), held, tokens - remaining,
                        move.written if move else 0)
    return move, eviction, (rid, policy, scores, kept) if remember else None


def scoring_job(due: Due, state: PolicyState | None, cached: torch.Tensor | None) -> ScoreJob | None:
    """What a due eviction must score: an accumulating policy its uncounted queries over every
    slot; a static-score policy in decode only the slots written since its scores were cached;
    otherwise every slot (an attention-aware policy with its whole window). None: nothing."""
    policy, source, tokens = due.policy, due.source, due.tokens
    if policy.accumulates:
        return counting_job(policy, source, tokens, state, due.request_id)
    if not policy.needs_kv or policy.reconstructs:
        return None  # a reconstructing score's passes already left its scores in the state
    if cached is not None and cached.shape[-1] > tokens:
        raise RuntimeError(f"kept scores for {cached.shape[-1]} tokens, but the request holds {tokens}")
    if due.phase == "decode" and policy.static_scores and cached is not None:
        return ScoreJob(policy, source, cached.shape[-1], tokens)
    windows = None
    if policy.query_window:
        windows = state.layer_windows(due.request_id, fresh_only=False)
        state.windows[due.request_id].fresh = 0
    return ScoreJob(policy, source, 0, tokens, windows)


def decision_scores(due: Due, state: PolicyState | None, cached: torch.Tensor | None,
                    fresh: torch.Tensor | None) -> torch.Tensor | None:
    """The scores the decision reads, from what ``scoring_job`` asked for."""
    policy = due.policy
    if policy.reconstructs:
        return reconstructed_scores(due, state)
    if policy.accumulates:
        if fresh is not None:
            fold_counted(policy, state, due.request_id, fresh)
        return state.scores[due.request_id]
    if fresh is None:
        return None
    if due.phase == "decode" and policy.static_scores and cached is not None:
        return torch.cat([cached, policy.cached_form(fresh)], dim=-1)
    return fresh


class MissingReconstructionError(RuntimeError):
    """A reconstructing policy (KVzip) must evict, but no reconstruction pass scored the request."""


def reconstructed_scores(due: Due, state: PolicyState | None) -> torch.Tensor:
    """The ``[layers, heads, tokens]`` scores a reconstructing policy's passes left for the request
    (every head: the engine gathers them across ranks before it stores them), taken from the state:
    they are read once, by this eviction (KVzip compresses once)."""
    scores = None if state is None else state.scores.pop(due.request_id, None)
    if scores is None:
        raise MissingReconstructionError(f"{due.policy.name} evicts from its reconstruction passes, but none ran "
                                         f"for request {due.request_id}")
    if scores.shape[-1] != due.tokens:
        raise RuntimeError(f"reconstruction scored {scores.shape[-1]} tokens, but the request holds {due.tokens}")
    return scores


def evict(policy: Policy, view: KVView, block_ids: list[int], tokens: int, phase: Phase,
          state: PolicyState | None = None, request_id: str = "", copy_targets: tuple[int, ...] = ()) -> Eviction:
    """One request's eviction (``evict_all`` with a single due)."""
    return evict_all(view, [Due(request_id, policy, block_ids, tokens, phase, copy_targets)], state)[request_id]

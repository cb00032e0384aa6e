"""Each policy's published rule applied directly to a Hugging Face ``DynamicCache``.

The oracle for eviction *semantics*: it imports nothing from ``policies/`` or ``harness/engine/``,
so a wrong decision there cannot hide in shared code. Written from the papers and the project's
decisions (``shared/design/PAGED_EVICTION.md``), one greedy request at a time, float32:

* RoPE positions stay logical while the cache shrinks (cache positions are physical);
* prefill eviction follows the forward pass over the whole prompt, when the prompt exceeds the
  budget C; decode eviction follows a step after which the cache holds C + B tokens or more and
  a whole number of blocks B;
* context compression (``context_tokens``, kvpress's query-agnostic setting): the forward pass
  over the context alone (the prompt's first tokens) is the prefill the eviction follows, as if the
  context were the prompt; the rest of the prompt (the question) is then run in one pass over what
  stayed, and nothing is evicted after it. There a block rule keeps exactly C, whole blocks (the
  first block, the last B tokens and the best middle; the project's decision for ``compress=context``,
  whose rules never evict in decode): ``context_tokens`` given to a rule that evicts in decode (only
  ``len(prompt)`` allows it) is prompt compression, L mod B kept as ever;
* a protected prefix (``protect_prefix`` N, the request's own setting): every cached token whose
  logical position is below N stays, whatever the rule, in prefill and in decode. They count inside
  the budget C: a token rule keeps them in place of its first edge where they reach past it (and
  its best middle shrinks by them); a block rule's prefill likewise, and in decode it never drops a
  block holding one; StreamingLLM's sinks are the first max(4, N) tokens;
* scores are compared at 11 significant bits, ties going to the earlier token (the harness's
  documented tie rule, so last-bit differences between two engines' K/V cannot flip a choice);
* attention-aware rules (SnapKV, H2O) read the queries of the newest W tokens: here each layer's
  query projection is recomputed from the attention module's input and rotated (RoPE) by hand,
  and attention is recomputed at eviction time over the cache as it is then (causal within the
  window), the harness's documented semantics;
* a hybrid model (Gemma 3: ``layer_types`` with sliding-window layers): the rule evicts the
  full-attention ("global") layers only, one group, masked by their own cache length as layer groups
  are; a sliding-window ("local") layer is never evicted and attends over the last W logical
  positions of what it holds (W = ``sliding_window``, the query's own included: Hugging Face's own
  sliding-window cache, and a window mask over it built here, as the global layers' are; vLLM's
  window is the same, single_type_kv_cache_manager.py:1135-1150, and tests/engine/test_hybrid_engine.py
  checks the full cache against stock vLLM); a context compressed before its question
  (``context_tokens``) evicts the global layers at the boundary, the question then attends as above;
* layer groups: given one rule per group of contiguous layers (group 0 the first), each group evicts
  on its own layers, at its own length and budget, so layers hold different numbers of tokens: each
  layer's attention then gets its own causal mask, built from that layer's own cache length;
* chained turns (``resume``, a multi-turn conversation with ``chain=true``): a turn's prompt is the
  previous turn's prompt, its output and a new message; the turn continues the cache the previous
  turn left (its prompt and all but its last output token, as evicted then: nothing of it is computed
  again), computes the tokens from there to its own context boundary at their logical positions, and
  the prefill eviction at the boundary runs on what the cache then holds (the kept history and those
  tokens), when that exceeds the turn's budget. The same evictions applied, turn by turn, to the
  concatenated turns: what one turn dropped no later turn holds. Attention-free rules only (a rule
  reading queries would need the previous turn's, which a chained turn does not have).
* KVzip (Kim et al., arXiv 2505.23416, as kvpress 0.5.5's ``KVzipPress`` computes it): when the
  prefill reaches the eviction point c (the context's end), the model is asked to repeat the context:
  for each chunk of the context after its chat header (``Repeat.prefix`` tokens), a pass over the
  cache of ``first + suffix + chunk`` (chunk 0) or ``later + previous chunk's last 8 ids + suffix +
  chunk`` at positions c.. (every chunk's pass starts again at c: the pass's own K/V is dropped after
  it). A context token's score is the largest attention it gets from any of the pass's queries in a
  softmax over the first 4 tokens, the chunk's tokens and the pass's own (causal), per KV head (the
  largest over the query heads reading it); the header's other tokens score 0 (never reconstructed),
  the first 4 are always kept. The question then runs at c.., on what stayed. Every KV head keeps
  the same count (the authors' ``pair-uniform`` level: a paged engine has one slot per token for
  all its heads). At block granularity the same scores choose PagedEviction's middle tokens per KV
  head (first block and last ``B + L mod B`` tokens kept; under context compression whole blocks,
  the last ``B``, C in all, as every block rule there). On a hybrid model the passes run through
  every layer, a local layer attending over its window (the last W - 1 context tokens it holds and
  the pass's own), and only the global layers are scored.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

EPS = 1e-6
LEARNED_WEIGHTS = Path(__file__).resolve().parents[2] / "policies" / "learned_scorer.json"


def rounded(scores: torch.Tensor) -> torch.Tensor:
    """Scores with 11 significant bits."""
    exponent = torch.floor(torch.log2(scores.abs().clamp_min(1e-30))) + 1
    step = torch.pow(2.0, exponent - 11)
    return torch.where(scores == 0, scores, torch.round(scores / step) * step)


def best_positions(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Positions (ascending) of the ``count`` highest scores along the last axis, earlier wins ties."""
    positions = torch.arange(scores.shape[-1]).expand_as(scores)
    # Sort by score descending, then by position ascending (lexsort by two stable sorts).
    by_position = torch.argsort(positions, dim=-1, stable=True)
    order = torch.argsort(-rounded(scores).gather(-1, by_position), dim=-1, stable=True)
    chosen = by_position.gather(-1, order)[..., :count]
    return chosen.sort(dim=-1).values


def keep_with_edges(scores: torch.Tensor, first: int, last: int, total: int) -> torch.Tensor:
    """Always the first ``first`` and last ``last`` tokens, the best of the rest up to ``total``."""
    length = scores.shape[-1]
    middle = best_positions(scores[..., first : length - last], total - first - last) + first
    lead = scores.shape[:-1]
    return torch.cat([torch.arange(first).expand(*lead, first), middle,
                      torch.arange(length - last, length).expand(*lead, last)], dim=-1)


def keydiff(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The keys least aligned with their head's mean key direction score highest."""
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    anchor = unit.mean(dim=1, keepdim=True)
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return -(unit * anchor).sum(dim=-1)


def learned(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The trained scorer: its committed weights (data, read here) times log-norm features."""
    fitted = json.loads(LEARNED_WEIGHTS.read_text())
    a, b = torch.log(k.norm(dim=-1) + 1e-6), torch.log(v.norm(dim=-1) + 1e-6)
    named = {"log_key_norm": a, "log_value_norm": b, "log_key_norm^2": a * a, "log_value_norm^2": b * b,
             "log_key_norm*log_value_norm": a * b}
    return sum(weight * named[name] for name, weight in zip(fitted["features"], fitted["weights"]))


# Attention-free scores by name, from one layer's ``[heads, tokens, dim]`` K/V: ``[heads, tokens]``,
# higher = keep.
KV_SCORES = {
    "paged": lambda k, v: v.norm(dim=-1) / k.norm(dim=-1).clamp_min(EPS),  # ||V|| / ||K||
    "knorm": lambda k, v: -k.norm(dim=-1),                                 # the lowest key norms kept
    "keydiff": keydiff,
    "value_norm": lambda k, v: v.norm(dim=-1),                             # the longest values kept
    "learned": learned,
    "recency": lambda k, v: torch.arange(k.shape[1], dtype=torch.float32).expand(k.shape[0], -1),
}
TOP_K = 16  # LRU: a query uses the tokens it attends to most
WINDOW = 32  # observation window of the attention-aware rules (queries)
# Attention-aware scores: which tokens their rule always keeps at token granularity (first, last),
# given the budget C and block B, and whether they choose per KV head or per layer.
# "newest": newest tokens kept at any granularity (at block granularity, the blocks holding them).
ATTENTION_RULES = {
    "snapkv": {"edges": lambda C, B: (0, WINDOW), "share": "head", "newest": WINDOW},
    "h2o": {"edges": lambda C, B: (0, C // 2), "share": "head"},
    "tova": {"edges": lambda C, B: (0, 0), "share": "layer"},
    "kvzip": {"edges": lambda C, B: (KVZIP_SINKS, 0), "share": "head"},
}
KVZIP_SINKS = 4      # kvpress's n_sink: the context's first tokens, always kept, always in the softmax
KVZIP_POSTFIX = 8    # ids of the previous chunk that a later chunk's repeat prompt ends with


def attention_received(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``[kv heads, tokens]``: attention each cached token got from ``queries`` ``[n, query heads,
    dim]`` (the newest n tokens, in the last n slots), summed over queries, averaged over the
    query heads reading each KV head. ``keys``: ``[kv heads, tokens, dim]``."""
    n, query_heads, _ = queries.shape
    kv_heads, length, _ = keys.shape
    per_query_head = []
    for h in range(query_heads):
        k = keys[h * kv_heads // query_heads]
        logits = queries[:, h] @ k.T * scale  # [n, tokens]
        for i in range(n):
            logits[i, length - n + i + 1:] = float("-inf")
        per_query_head.append(torch.softmax(logits, dim=-1).sum(dim=0))
    return torch.stack(per_query_head).view(kv_heads, query_heads // kv_heads, length).mean(dim=1)


class Repeat:
    """What KVzip's reconstruction of one request's context is made of (token ids, tokenizer-made):
    ``prefix`` leading context tokens never reconstructed (the chat header), the repeat prompt of the
    first chunk and of later ones, the chat footer (``suffix``) and the chunk length."""

    def __init__(self, prefix: int, first: Sequence[int], later: Sequence[int], suffix: Sequence[int],
                 chunk: int = 2048):
        self.prefix, self.first, self.later, self.suffix, self.chunk = prefix, list(first), list(later), list(suffix), chunk

    def passes(self, context: Sequence[int]) -> list[tuple[list[int], int, int]]:
        """Each pass's input ids, with the context positions [start, end) of the chunk it repeats."""
        out = []
        for start in range(self.prefix, len(context), self.chunk):
            end = min(start + self.chunk, len(context))
            # a later chunk's prompt ends with the previous chunk's last ids (all of it, if shorter)
            previous = list(context[max(start - KVZIP_POSTFIX, start - self.chunk):start])
            lead = self.first if start == self.prefix else self.later + previous
            out.append((lead + self.suffix + list(context[start:end]), start, end))
        return out


def kvzip_chunk_scores(queries: torch.Tensor, keys: torch.Tensor, start: int, end: int, scale: float) -> torch.Tensor:
    """``[kv heads, end - start]``: for the chunk ``[start, end)`` of the context, the largest
    attention each of its tokens gets from one pass's queries ``[r, query heads, dim]``, in a
    softmax over the context's first ``min(4, start)`` tokens, the chunk and the pass's own r tokens
    (causal among them), per KV head: the largest over its query heads too. ``keys``: ``[kv heads,
    context + r, dim]``, the layer's cache with the pass's keys appended."""
    r, query_heads, _ = queries.shape
    kv_heads, length, _ = keys.shape
    columns = torch.cat([torch.arange(min(KVZIP_SINKS, start)), torch.arange(start, end),
                         torch.arange(length - r, length)])
    lead = min(KVZIP_SINKS, start)
    hidden = torch.ones(r, r, dtype=torch.bool).triu(diagonal=1)  # pass token i reads its tokens 0..i
    best = torch.zeros(kv_heads, end - start)
    for h in range(query_heads):
        kv = h * kv_heads // query_heads
        logits = queries[:, h] @ keys[kv, columns].T * scale  # [r, columns]
        logits[:, -r:] = logits[:, -r:].masked_fill(hidden, float("-inf"))
        received = torch.softmax(logits, dim=-1)[:, lead : lead + end - start].max(dim=0).values
        best[kv] = torch.maximum(best[kv], received)
    return best


def average_pool(votes: torch.Tensor, kernel: int) -> torch.Tensor:
    """Mean over a centred window of ``kernel`` positions, positions off either end counting 0."""
    length = votes.shape[-1]
    out = torch.zeros_like(votes)
    for offset in range(-(kernel // 2), kernel // 2 + 1):
        lo, hi = max(0, -offset), min(length, length - offset)
        out[..., lo:hi] += votes[..., lo + offset:hi + offset]
    return out / kernel


class PlainPolicy:
    """A rule, by its score and selection parameters: which cached tokens stay, as
    ``[layers, heads, kept]`` indices, or in decode at block granularity the block that leaves.

    ``score``: a ``KV_SCORES`` or ``ATTENTION_RULES`` name, or "streaming" (4 sinks + recent).
    ``granularity``: "token" (the budget's best tokens, first and last block protected unless the
    rule names its edges, compacted) or "block" (PagedEviction's rule: first block, the last
    ``B + L mod B`` tokens and the best middle after prefill, ``C + L mod B`` in all, or with
    ``whole_blocks`` (context compression) the last ``B`` and ``C`` in all; the lowest-mean full
    block in decode; a rule that keeps its newest tokens keeps every block holding them).
    ``per_head``: one choice per layer and KV head, or one per request from the mean over layers and
    heads (token default True, block default False; rules that fix it ignore it).
    """

    def __init__(self, score: str, granularity: str, budget: int, block: int, per_head: bool | None = None,
                 protect_edges: bool = True, weights: dict | None = None, decode_eviction: bool = True,
                 repeat: Repeat | None = None, protect_prefix: int = 0):
        self.score, self.granularity, self.budget, self.block = score, granularity, budget, block
        self.protect_prefix = protect_prefix  # tokens at logical positions below it always stay
        self.repeat = repeat  # kvzip: the request's reconstruction inputs
        self.reconstructed: torch.Tensor | None = None  # kvzip: [layers, heads, context] scores, set by generate
        self.decode_eviction = decode_eviction  # False: the prompt is compressed, the answer never
        self.per_head = (granularity == "token") if per_head is None else per_head
        self.protect_edges = protect_edges
        self.weights = weights or {}  # hybrid: score name -> weight
        self.reset()

    @property
    def counts_queries(self) -> bool:
        """Rules whose state sums up every query (H2O's totals, LRU's ages)."""
        return self.score in ("h2o", "lru")

    def reset(self) -> None:
        """A new request: the state of H2O (attention totals) and LRU (ages) starts empty."""
        self.totals: torch.Tensor | None = None

    def count(self, keys: list[torch.Tensor], queries: list[torch.Tensor], scale: float) -> None:
        """Fold ``queries`` (the step's newest tokens, oldest first) into the state: H2O adds the
        attention each paid every cached token to its total (new tokens start from zero); LRU takes
        them one at a time: every token ages by one, and the tokens a query attends to most (and
        the one it wrote) become zero old."""
        length = keys[0].shape[1]
        old = torch.zeros(len(keys), keys[0].shape[0], length)
        if self.totals is not None:
            old[..., : self.totals.shape[-1]] = self.totals
        if self.score == "h2o":
            self.totals = old + torch.stack([attention_received(q, k, scale) for q, k in zip(queries, keys)])
            return
        for layer, (q, k) in enumerate(zip(queries, keys)):
            for i in range(q.shape[0]):
                slot = length - q.shape[0] + i
                old[layer, :, : slot + 1] += 1
                seen = attention_received(q[i : i + 1], k[:, : slot + 1], scale)  # [kv heads, slot + 1]
                used = best_positions(seen, min(TOP_K, slot + 1))
                old[layer].scatter_(-1, used, 0.0)
                old[layer, :, slot] = 0.0
        self.totals = old

    def component(self, score: str, keys, values, queries, scale) -> torch.Tensor:
        """``[layers, heads, tokens]`` scores of one named score."""
        if score in KV_SCORES:
            return torch.stack([KV_SCORES[score](k, v) for k, v in zip(keys, values)])
        if score == "h2o":
            return self.totals
        if score == "lru":  # the youngest kept
            return -self.totals
        if score == "kvzip":  # what the reconstruction read (PlainReference.generate puts it here)
            if self.reconstructed is None:
                raise ValueError("kvzip's scores come from the reconstruction passes, which ran for no context")
            return self.reconstructed
        if score == "tova":  # the newest query's attention (per KV head; a layer's choice averages them)
            return torch.stack([attention_received(q[-1:], k, scale) for q, k in zip(queries, keys)])
        if score == "hybrid":  # weighted scores, each scaled to [0, 1] per layer and head
            total = 0
            for name, weight in self.weights.items():
                part = self.component(name, keys, values, queries, scale).expand(len(keys), keys[0].shape[0], -1)
                low, high = part.min(dim=-1, keepdim=True).values, part.max(dim=-1, keepdim=True).values
                scaled = torch.where(high > low, (part - low) / (high - low), torch.zeros_like(part))
                total = total + weight * scaled
            return total
        votes = []  # snapkv: the window's votes, average-pooled before the window (kernel 5)
        for q, k in zip(queries, keys):
            received = attention_received(q, k, scale)
            before = k.shape[1] - q.shape[0]
            votes.append(torch.cat([average_pool(received[:, :before], 5), received[:, before:]], dim=-1))
        return torch.stack(votes)

    def scores(self, keys, values, queries, scale) -> torch.Tensor:
        return self.component(self.score, keys, values, queries, scale)

    def share(self) -> str:
        fixed = ATTENTION_RULES.get(self.score, {}).get("share")
        if self.granularity == "block":  # block keep sets: per KV head, or one per request
            return "head" if fixed == "head" or (fixed is None and self.per_head) else "request"
        return fixed or ("head" if self.per_head else "request")

    def protected(self, positions: list[torch.Tensor] | None, length: int) -> int:
        """How many cached tokens the protected prefix holds: those at logical positions below N
        (``positions[l]``: ``[heads, tokens]``, what each slot holds; None: the cache is the
        request's first ``length`` tokens, nothing evicted yet). Kept from the first eviction on,
        they are the first slots of every layer and head (asserted here)."""
        if not self.protect_prefix:
            return 0
        if positions is None:
            return min(self.protect_prefix, length)
        held = int((positions[0][0] < self.protect_prefix).sum())
        for layer in positions:
            assert ((layer < self.protect_prefix) == (torch.arange(layer.shape[-1]) < held)).all(), \
                "the protected tokens are the first slots of every layer and head"
        return held

    def keep(self, keys: list[torch.Tensor], values: list[torch.Tensor], phase: str,
             queries: list[torch.Tensor] | None = None, scale: float = 1.0,
             whole_blocks: bool = False, positions: list[torch.Tensor] | None = None) -> torch.Tensor | int:
        """``keys[l]``/``values[l]``: ``[heads, tokens, dim]``; ``queries[l]``: the window,
        ``[n, query heads, dim]``; ``whole_blocks``: a block rule's prefill keeps C exactly;
        ``positions[l]``: the logical position each slot holds (``protected``)."""
        C, B = self.budget, self.block
        heads, length = keys[0].shape[0], keys[0].shape[1]
        layers = len(keys)
        held = self.protected(positions, length)  # the first slots, never evicted
        if self.score == "streaming":  # 4 attention sinks (or the protected prefix) + the most recent tokens
            sinks = max(4, held)
            kept = torch.cat([torch.arange(sinks), torch.arange(length - (C - sinks), length)])
            return kept.expand(layers, heads, -1)
        scores = self.scores(keys, values, queries, scale)
        if self.granularity == "block" and phase == "decode":
            victim = self._lowest_block(scores.mean(dim=(0, 1)), length, held)
            if self.totals is not None:
                self.totals = torch.cat([self.totals[..., : victim * B], self.totals[..., (victim + 1) * B:]], dim=-1)
            return victim
        if self.granularity == "block":
            remainder = 0 if whole_blocks else length % B  # the partial last block, kept beside C
            first, last, total = B, self._newest_blocks() * B + remainder, C + remainder
        else:
            rule = ATTENTION_RULES.get(self.score)
            first, last = rule["edges"](C, B) if rule else ((B, B) if self.protect_edges else (0, 0))
            total = C
        first = max(first, held)  # the protected tokens lead the cache: they stay with the first edge
        share = self.share()
        if share == "head":
            kept = keep_with_edges(scores.expand(layers, heads, -1), first, last, total)
        elif share == "layer":
            kept = keep_with_edges(scores.mean(dim=1), first, last, total)[:, None, :].expand(layers, heads, -1)
        else:
            kept = keep_with_edges(scores.mean(dim=(0, 1)), first, last, total).expand(layers, heads, -1)
        if self.totals is not None:
            self.totals = self.totals.gather(-1, kept)
        return kept

    def _newest_blocks(self) -> int:
        """Block granularity: the newest block, or all blocks holding the newest tokens the rule keeps."""
        newest = ATTENTION_RULES.get(self.score, {}).get("newest", 0)
        return max(1, -(-newest // self.block))

    def _lowest_block(self, per_token: torch.Tensor, length: int, held: int = 0) -> int:
        B = self.block
        blocks = length // B
        block_scores = rounded(per_token[: blocks * B].view(blocks, B).mean(dim=-1))
        # never the first, never one holding a protected token (the first ``held`` slots), never the newest
        start = max(1, -(-held // B))
        candidates = block_scores[start : blocks - self._newest_blocks()]
        return start + int(torch.nonzero(candidates == candidates.min())[0])


def reads_queries(policy: PlainPolicy) -> bool:
    """Rules that read queries or count them (H2O, LRU, SnapKV, TOVA, a hybrid using one): H2O's
    totals and LRU's ages live in the rule object, so layer groups need one object each."""
    names = policy.weights if policy.score == "hybrid" else [policy.score]
    return any(name not in KV_SCORES and name != "streaming" for name in names)


def chunk_mask(past: int, width: int) -> torch.Tensor:
    """``[1, 1, width, past + width]`` additive mask for a layer holding ``past`` cached tokens (in
    its first slots, whatever their logical positions): the chunk's query i reads every cached
    token and the chunk's tokens 0..i. The value Hugging Face's eager masks use for "hidden"."""
    visible = torch.ones(width, past + width, dtype=torch.bool).tril(diagonal=past)
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


def window_chunk_mask(past: int, width: int, window: int) -> torch.Tensor:
    """``[1, 1, width, past + width]`` additive mask for a sliding-window layer holding the ``past``
    tokens logically just before the chunk (never evicted: its slots are its positions): the chunk's
    query i reads what lies within ``window`` positions of it, its own included, causally."""
    query = torch.arange(width)[:, None] + past
    key = torch.arange(past + width)[None, :]
    visible = (key <= query) & (query - key < window)
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama applies it: the two halves of head_dim rotated by each position's angle."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class PlainReference:
    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        config = self.model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # the attention's own softmax scale (Gemma 3: query_pre_attn_scalar ** -0.5; Llama: head_dim ** -0.5)
        self.scale = float(self.model.model.layers[0].self_attn.scaling)
        # a hybrid model's sliding-window layers: never evicted (see the module's "hybrid model")
        self.local_layers = frozenset(i for i, kind in enumerate(getattr(config, "layer_types", None) or ())
                                      if kind == "sliding_attention")
        self.window = getattr(config, "sliding_window", None)
        self.queries: list[torch.Tensor] = []  # per layer, the newest queries [n, query heads, dim]
        # Set while groups evict apart: Hugging Face builds one mask, from layer 0's length.
        self.per_layer_masks = False
        self.whole_pass = False  # set during a KVzip reconstruction pass: every query of it is recorded
        # After generate: the request's cache, and per layer the logical positions it holds [heads, tokens].
        self.cache = None
        self.positions: list[torch.Tensor] = []
        self.chain_tokens: list[int] | None = None  # the logical tokens the cache holds after generate
        for index, layer in enumerate(self.model.model.layers):
            layer.self_attn.register_forward_pre_hook(self._query_recorder(index), with_kwargs=True)
            layer.self_attn.register_forward_pre_hook(self._own_mask(index), with_kwargs=True)

    def _own_mask(self, index: int):
        """Replaces the model-wide mask by this layer's own: its cache length is read from the cache
        itself before the layer appends the chunk, so it cannot drift from what the layer attends over.
        A local layer's: the window over the tokens its cache holds (Hugging Face's sliding-window
        layer keeps the last W - 1 and attends over them and the chunk: DynamicSlidingWindowLayer.update),
        built here because Hugging Face's would follow the global layers' cache positions, which
        eviction moved."""
        def mask(module, args, kwargs):
            if not self.per_layer_masks:
                return None
            if "attention_mask" not in kwargs or "past_key_values" not in kwargs:
                raise RuntimeError("this transformers calls attention differently: the layer masks need updating")
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cache = kwargs["past_key_values"]
            if index in self.local_layers:
                layer = cache.layers[index]
                held = layer.keys.shape[-2] if getattr(layer, "is_initialized", False) else 0
                return args, {**kwargs, "attention_mask": window_chunk_mask(held, hidden.shape[1], self.window)}
            past = cache.get_seq_length(index)
            return args, {**kwargs, "attention_mask": chunk_mask(past, hidden.shape[1])}
        return mask

    def _query_recorder(self, index: int):
        def record(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(hidden)[0].view(hidden.shape[1], -1, self.head_dim)  # [new, heads, dim]
            if getattr(module, "q_norm", None) is not None:  # Gemma 3 normalizes queries before RoPE
                q = module.q_norm(q)
            q = rotate(q, cos[0][:, None, :], sin[0][:, None, :])
            old = self.queries[index] if index < len(self.queries) else q[:0]
            joined = q if self.whole_pass else torch.cat([old, q])[-WINDOW:]
            if index < len(self.queries):
                self.queries[index] = joined
            else:
                self.queries.append(joined)
        return record

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int, policy: PlainPolicy | Sequence[PlainPolicy],
                 context_tokens: int | None = None, resume: bool = False) -> tuple[list[int], dict]:
        """Greedy output ids, and how many passes each phase's evictions followed. ``context_tokens``:
        the prefill eviction runs after the prompt's first ``context_tokens`` tokens (the
        context), before the rest (the question) is computed; None: after the whole prompt.

        ``policy``: one rule for every layer, or one per layer group (G rules, G dividing the layers;
        each group its own rule object): group g's rule evicts layers [g L/G, (g + 1) L/G) by
        its own budget, when its own layers' length calls for it. The counts add, per group,
        ``groups[g]`` ({"prefill", "decode", "decode_at": the logical lengths its decode evictions
        followed}), and ``lengths``: each layer's cached tokens at the end.

        ``resume``: the next turn of a conversation (see the module's "chained turns"): ``prompt``
        begins with the previous call's prompt and output; the previous call's cache is continued."""
        from transformers import DynamicCache

        policies = [policy] if isinstance(policy, PlainPolicy) else list(policy)
        layers = len(self.model.model.layers)
        if not policies or layers % len(policies):
            raise ValueError(f"{len(policies)} layer groups for {layers} layers: the groups must divide the layers")
        if len(policies) > 1 and any(reads_queries(rule) for rule in policies) and \
                len({id(rule) for rule in policies}) < len(policies):
            # The recorded queries are per layer (each group reads its own layers'), but H2O's totals and
            # LRU's ages live in the rule: each group needs a rule object of its own.
            raise ValueError("layer groups: a rule that reads queries keeps per-request state; give each group "
                             "its own rule object")
        span = layers // len(policies)
        groups = [range(g * span, (g + 1) * span) for g in range(len(policies))]
        if self.local_layers:
            if len(policies) != 1 or resume:
                raise ValueError("a hybrid model: one rule on its global layers (layer groups and chained turns are "
                                 "not built for it)")
            groups = [[l for l in range(layers) if l not in self.local_layers]]
        evict_at = len(prompt) if context_tokens is None else context_tokens
        if not 0 < evict_at <= len(prompt):
            raise ValueError(f"context_tokens={context_tokens} for a prompt of {len(prompt)} tokens")
        if evict_at < len(prompt) and any(rule.decode_eviction for rule in policies):
            # A decode eviction would drop question tokens too: the setting compresses the context once.
            raise ValueError("context compression evicts the context only: the rule needs decode_eviction=False")
        for rule in policies:
            rule.reset()
            if rule.score == "kvzip" and (rule.decode_eviction or rule.repeat is None):
                raise ValueError("kvzip compresses once, from its reconstruction: it needs decode_eviction=False "
                                 "and the request's Repeat")
        self.queries = []
        heads = self.model.config.num_key_value_heads
        if resume:
            held = self.chain_tokens
            if held is None or self.cache is None:
                raise ValueError("resume continues the previous turn's cache: there is none")
            if list(prompt[: len(held)]) != held:
                raise ValueError("a chained turn's prompt begins with the previous turn's prompt and output")
            if not len(held) < evict_at:
                raise ValueError(f"a chained turn computes at least one token before its boundary ({evict_at}); the "
                                 f"previous turn's cache holds {len(held)}")
            if any(reads_queries(rule) for rule in policies):
                raise ValueError("chained turns: attention-free rules only (a rule reading queries would need the "
                                 "previous turn's)")
            cache = self.cache
            # physical: each group's cached tokens, as the previous turn left them
            logical, physical = len(held), [cache.get_seq_length(members[0]) for members in groups]
        else:
            cache = DynamicCache(config=self.model.config)
            self.positions = [torch.zeros(heads, 0, dtype=torch.long) for _ in range(layers)]
            logical, physical = 0, [0] * len(policies)
        self.chain_tokens = None
        # One group: Hugging Face's own mask, as ever. Several: each layer's own (see _own_mask), even
        # while the lengths still agree, so a wrong layer mask shows against one group's output.
        self.per_layer_masks = len(policies) > 1 or bool(self.local_layers)
        out = []
        counts = {"prefill": 0, "decode": 0, "groups": [{"prefill": 0, "decode": 0, "decode_at": []} for _ in policies]}
        step = torch.tensor([prompt[logical:evict_at]])
        try:
            while len(out) < new_tokens:
                width = step.shape[1]
                # cache_position: group 0's slots. This transformers' Llama ignores it: the cache
                # appends, and its one mask follows layer 0's cached length, which is why groups
                # replace that mask in every layer (_own_mask). Positions stay logical.
                logits = self.model(input_ids=step, position_ids=torch.arange(logical, logical + width)[None],
                                    cache_position=torch.arange(physical[0], physical[0] + width),
                                    past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                new = torch.arange(logical, logical + width).expand(heads, -1)
                self.positions = [torch.cat([held, new], dim=-1) for held in self.positions]
                logical, physical = logical + width, [length + width for length in physical]
                prefill = logical == evict_at  # the pass that completed the prompt (or the context)
                if prefill and any(rule.score == "kvzip" for rule in policies):
                    reconstructed = self._reconstruct(cache, prompt[:evict_at], policies)
                    for rule, members in zip(policies, groups):
                        rule.reconstructed = reconstructed[list(members)]
                phases = set()
                for g, (rule, members) in enumerate(zip(policies, groups)):
                    # The prompt's (or context's) last WINDOW queries, then every decode query (a question's
                    # last WINDOW too, never read: nothing is evicted after a question).
                    if rule.counts_queries:
                        counted = min(width, WINDOW)
                        rule.count([cache.layers[l].keys[0] for l in members],
                                   [self.queries[l][self.queries[l].shape[0] - counted:] for l in members],
                                   self.scale)
                    if prefill and physical[g] > rule.budget:
                        phase = "prefill"
                    elif (rule.decode_eviction and not prefill and physical[g] >= rule.budget + rule.block
                          and physical[g] % rule.block == 0):
                        phase = "decode"
                        counts["groups"][g]["decode_at"].append(logical)
                    else:
                        continue
                    held = physical[g]
                    # context compression (the engine's compress=context, never evicting in decode):
                    # whole blocks
                    whole = context_tokens is not None and not rule.decode_eviction
                    physical[g] = self._apply(cache, rule, phase, members, whole)
                    if phase == "prefill" and physical[g] == held:
                        # A block rule compressing a whole prompt keeps budget + (held mod block): held within
                        # a block of the budget keeps everything. Nothing was evicted, as the engine counts.
                        continue
                    counts["groups"][g][phase] += 1
                    phases.add(phase)
                for phase in phases:
                    counts[phase] += 1
                if logical < len(prompt):  # the context is in and evicted: the question, before any output
                    step = torch.tensor([prompt[logical:]])
                    continue
                out.append(int(logits[0, -1].argmax()))
                step = torch.tensor([[out[-1]]])
        finally:
            self.per_layer_masks = False
        self.cache = cache
        # what the cache holds: the prompt and every output but the last (never computed)
        self.chain_tokens = list(prompt) + out[:-1]
        counts["lengths"] = [cache.get_seq_length(l) for l in range(layers)]
        return out, counts

    def _reconstruct(self, cache, context: list[int], policies: list[PlainPolicy]) -> torch.Tensor:
        """KVzip's ``[layers, kv heads, context]`` scores: one pass per chunk over the cache of the
        whole context (nothing evicted yet), at positions c.., its K/V dropped once it is scored.
        A hybrid model's local layers run each pass over their window (their own mask) and are not
        scored (rows of 0: never read); their cache is put back as it was before the pass."""
        repeats = {(r.repeat.prefix, tuple(r.repeat.first), tuple(r.repeat.later), tuple(r.repeat.suffix),
                    r.repeat.chunk) for r in policies if r.score == "kvzip"}
        if len(repeats) != 1:
            raise ValueError("kvzip in several layer groups: every group reconstructs the same context the same way")
        repeat = next(r.repeat for r in policies if r.score == "kvzip")
        c, layers = len(context), len(self.model.model.layers)
        if any(cache.get_seq_length(l) != c for l in range(layers)):
            raise ValueError("kvzip reconstructs the whole context: a layer holds other than its c tokens")
        scores = torch.zeros(layers, self.model.config.num_key_value_heads, c)
        window, self.queries = self.queries, []
        self.whole_pass = True  # the recorder keeps every query of the pass
        try:
            for ids, start, end in repeat.passes(context):
                r = len(ids)
                self.queries = []
                local = {l: (cache.layers[l].keys, cache.layers[l].values, cache.layers[l].cumulative_length)
                         for l in self.local_layers}
                # The backbone alone (no logits are read); positions continue from the context's end.
                self.model.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(c, c + r)[None],
                                 cache_position=torch.arange(c, c + r), past_key_values=cache, use_cache=True)
                for l in range(layers):
                    layer = cache.layers[l]
                    if l in local:  # the window it held before the pass
                        layer.keys, layer.values, layer.cumulative_length = local[l]
                        continue
                    scores[l, :, start:end] = kvzip_chunk_scores(self.queries[l], layer.keys[0], start, end,
                                                                 self.scale)
                    layer.keys, layer.values = layer.keys[:, :, :c].contiguous(), layer.values[:, :, :c].contiguous()
        finally:
            self.whole_pass = False
            self.queries = window
        scores[..., :KVZIP_SINKS] = scores.max() + 1  # the sinks outrank everything
        return scores

    def _apply(self, cache, policy: PlainPolicy, phase: str, members: Sequence[int], whole_blocks: bool = False) -> int:
        """Evicts on the group's layers ``members`` only: the rule sees their K/V (and queries) alone."""
        keys = [cache.layers[l].keys[0] for l in members]
        values = [cache.layers[l].values[0] for l in members]
        kept = policy.keep(keys, values, phase, [self.queries[l] for l in members], self.scale,
                           whole_blocks, [self.positions[l] for l in members])
        if isinstance(kept, int):  # a whole block leaves
            length = keys[0].shape[1]
            index = torch.cat([torch.arange(kept * policy.block), torch.arange((kept + 1) * policy.block, length)])
            kept = index.expand(len(keys), keys[0].shape[0], -1)
        for l, layer_kept in zip(members, kept):
            layer = cache.layers[l]
            gather = layer_kept[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather).contiguous()
            layer.values = layer.values.gather(2, gather).contiguous()
            self.positions[l] = self.positions[l].gather(-1, layer_kept)
        return kept.shape[-1]

"""Each policy's published rule applied directly to a Hugging Face ``DynamicCache``.

The oracle for eviction *semantics*: it imports nothing from ``policies/`` or ``harness/engine/``,
so a wrong decision there cannot hide in shared code. Written from the papers and the project's
decisions (``shared/design/PAGED_EVICTION.md``), one greedy request at a time, float32:

* RoPE positions stay logical while the cache shrinks (cache positions are physical);
* prefill eviction follows the forward pass over the whole prompt, when the prompt exceeds the
  budget C; decode eviction follows a step after which the cache holds C + B tokens or more and
  a whole number of blocks B;
* scores are compared at 11 significant bits, ties going to the earlier token (the harness's
  documented tie rule, so last-bit differences between two engines' K/V cannot flip a choice);
* attention-aware rules (SnapKV, H2O) read the queries of the newest W tokens: here each layer's
  query projection is recomputed from the attention module's input and rotated (RoPE) by hand,
  and attention is recomputed at eviction time over the cache as it is then (causal within the
  window), the harness's documented semantics.
"""
from __future__ import annotations

import torch

EPS = 1e-6


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


def token_scores(score: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """``[layers, heads, tokens]`` scores, higher = keep: ||V||/||K||, -||K|| or KeyDiff's."""
    rows = []
    for k, v in zip(keys, values):
        if score == "ratio":
            rows.append(v.norm(dim=-1) / k.norm(dim=-1).clamp_min(EPS))
        elif score == "key_norm":  # the lowest key norms are kept
            rows.append(-k.norm(dim=-1))
        else:  # keydiff: the keys least aligned with the mean key direction
            unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            anchor = unit.mean(dim=1, keepdim=True)
            anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            rows.append(-(unit * anchor).sum(dim=-1))
    return torch.stack(rows)


# name -> (score, granularity). Block: PagedEviction's rule (shared keep set, whole blocks in decode);
# token: per layer and head, the first and last block protected, compacted in decode.
RULES = {
    "paged": ("ratio", "block"), "paged_token": ("ratio", "token"),
    "knorm": ("key_norm", "token"), "knorm_block": ("key_norm", "block"),
    "keydiff": ("keydiff", "token"), "keydiff_block": ("keydiff", "block"),
}


WINDOW = 32  # observation window of the attention-aware rules (queries)


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


def average_pool(votes: torch.Tensor, kernel: int) -> torch.Tensor:
    """Mean over a centred window of ``kernel`` positions, positions off either end counting 0."""
    length = votes.shape[-1]
    out = torch.zeros_like(votes)
    for offset in range(-(kernel // 2), kernel // 2 + 1):
        lo, hi = max(0, -offset), min(length, length - offset)
        out[..., lo:hi] += votes[..., lo + offset:hi + offset]
    return out / kernel


class PlainPolicy:
    """The rules, by name: which cached tokens stay, as ``[layers, heads, kept]`` indices."""

    def __init__(self, name: str, budget: int, block: int):
        self.name, self.budget, self.block = name, budget, block
        self.reset()

    def reset(self) -> None:
        """A new request: H2O's attention totals start empty."""
        self.totals: list[torch.Tensor] | None = None

    def keep(self, keys: list[torch.Tensor], values: list[torch.Tensor], phase: str,
             queries: list[torch.Tensor] | None = None, scale: float = 1.0) -> torch.Tensor | int:
        """``keys[l]``/``values[l]``: ``[heads, tokens, dim]``. A block index in decode for a block rule.
        ``queries[l]``: the window, ``[n, query heads, dim]`` (for H2O: the queries not yet counted)."""
        C, B = self.budget, self.block
        heads, length = keys[0].shape[0], keys[0].shape[1]
        layers = len(keys)
        if self.name == "streaming":  # 4 attention sinks + the most recent tokens
            kept = torch.cat([torch.arange(4), torch.arange(length - (C - 4), length)])
            return kept.expand(layers, heads, -1)
        if self.name == "h2o":  # totals over every query; the newest C/2 tokens and the heaviest rest
            added = [attention_received(q, k, scale) for q, k in zip(queries, keys)]
            if self.totals is not None:
                for total, new in zip(self.totals, added):
                    new[:, : total.shape[-1]] += total
            recent = C // 2
            kept = keep_with_edges(torch.stack(added), 0, recent, C)
            self.totals = list(torch.stack(added).gather(-1, kept))
            return kept
        if self.name == "tova":  # the newest query's attention, averaged over all heads, per layer
            newest = [attention_received(q[-1:], k, scale).mean(dim=0) for q, k in zip(queries, keys)]
            return keep_with_edges(torch.stack(newest), 0, 0, C)[:, None, :].expand(layers, heads, -1)
        if self.name in ("snapkv", "snapkv_block"):  # pooled votes of the window, per KV head
            scores = []
            for q, k in zip(queries, keys):
                votes = attention_received(q, k, scale)
                before = length - q.shape[0]
                scores.append(torch.cat([average_pool(votes[:, :before], 5), votes[:, before:]], dim=-1))
            scores = torch.stack(scores)
            if self.name == "snapkv":
                return keep_with_edges(scores, 0, WINDOW, C)
            if phase == "prefill":  # per KV head, first block and tail protected
                return keep_with_edges(scores, B, B + length % B, C + length % B)
            return self._lowest_block(scores.mean(dim=(0, 1)), length)
        score, granularity = RULES[self.name]
        scores = token_scores(score, keys, values)
        if granularity == "token":
            return keep_with_edges(scores, B, B, C)
        per_token = scores.mean(dim=(0, 1))  # averaged over layers and heads
        if phase == "prefill":
            kept = keep_with_edges(per_token, B, B + length % B, C + length % B)
            return kept.expand(layers, heads, -1)
        return self._lowest_block(per_token, length)

    def _lowest_block(self, per_token: torch.Tensor, length: int) -> int:
        B = self.block
        blocks = length // B
        block_scores = rounded(per_token[: blocks * B].view(blocks, B).mean(dim=-1))
        candidates = block_scores[1 : blocks - 1]  # never the first block, never the newest
        return 1 + int(torch.nonzero(candidates == candidates.min())[0])


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
        self.queries: list[torch.Tensor] = []  # per layer, the newest queries [n, query heads, dim]
        for index, layer in enumerate(self.model.model.layers):
            layer.self_attn.register_forward_pre_hook(self._query_recorder(index), with_kwargs=True)

    def _query_recorder(self, index: int):
        def record(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(hidden)[0].view(hidden.shape[1], -1, self.head_dim)  # [new, heads, dim]
            q = rotate(q, cos[0][:, None, :], sin[0][:, None, :])
            old = self.queries[index] if index < len(self.queries) else q[:0]
            joined = torch.cat([old, q])[-WINDOW:]
            if index < len(self.queries):
                self.queries[index] = joined
            else:
                self.queries.append(joined)
        return record

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int, policy: PlainPolicy) -> tuple[list[int], dict]:
        """Greedy output ids, and how many evictions of each phase happened."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        policy.reset()
        self.queries = []
        self.uncounted = 0  # queries no eviction has counted yet (H2O)
        logical, physical, out = 0, 0, []
        counts = {"prefill": 0, "decode": 0}
        step = torch.tensor([prompt])
        while len(out) < new_tokens:
            width = step.shape[1]
            logits = self.model(input_ids=step, position_ids=torch.arange(logical, logical + width)[None],
                                cache_position=torch.arange(physical, physical + width),
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            logical, physical = logical + width, physical + width
            self.uncounted += width
            out.append(int(logits[0, -1].argmax()))
            prefill = len(out) == 1
            if prefill and physical > policy.budget:
                physical = self._apply(cache, policy, "prefill")
                counts["prefill"] += 1
            elif not prefill and physical >= policy.budget + policy.block and physical % policy.block == 0:
                physical = self._apply(cache, policy, "decode")
                counts["decode"] += 1
            step = torch.tensor([[out[-1]]])
        return out, counts

    def _apply(self, cache, policy: PlainPolicy, phase: str) -> int:
        keys = [layer.keys[0] for layer in cache.layers]
        values = [layer.values[0] for layer in cache.layers]
        counted = min(self.uncounted, WINDOW) if policy.name == "h2o" else WINDOW
        queries = [q[q.shape[0] - counted:] for q in self.queries]
        self.uncounted = 0
        kept = policy.keep(keys, values, phase, queries, self.head_dim ** -0.5)
        if isinstance(kept, int):  # a whole block leaves
            length = keys[0].shape[1]
            index = torch.cat([torch.arange(kept * policy.block), torch.arange((kept + 1) * policy.block, length)])
            kept = index.expand(len(keys), keys[0].shape[0], -1)
        for layer, layer_kept in zip(cache.layers, kept):
            gather = layer_kept[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather).contiguous()
            layer.values = layer.values.gather(2, gather).contiguous()
        return kept.shape[-1]

"""Each policy's published rule applied directly to a Hugging Face ``DynamicCache``.

The oracle for eviction *semantics*: it imports nothing from ``policies/`` or ``harness/engine/``,
so a wrong decision there cannot hide in shared code. Written from the papers and the project's
decisions (``shared/design/PAGED_EVICTION.md``), one greedy request at a time, float32:

* RoPE positions stay logical while the cache shrinks (cache positions are physical);
* prefill eviction follows the forward pass over the whole prompt, when the prompt exceeds the
  budget C; decode eviction follows a step after which the cache holds C + B tokens or more and
  a whole number of blocks B;
* scores are compared at 11 significant bits, ties going to the earlier token (the harness's
  documented tie rule, so last-bit differences between two engines' K/V cannot flip a choice).
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


class PlainPolicy:
    """The rules, by name: which cached tokens stay, as ``[layers, heads, kept]`` indices."""

    def __init__(self, name: str, budget: int, block: int):
        self.name, self.budget, self.block = name, budget, block

    def keep(self, keys: list[torch.Tensor], values: list[torch.Tensor], phase: str) -> torch.Tensor | int:
        """``keys[l]``/``values[l]``: ``[heads, tokens, dim]``. A block index in decode for a block rule."""
        C, B = self.budget, self.block
        heads, length = keys[0].shape[0], keys[0].shape[1]
        layers = len(keys)
        if self.name == "streaming":  # 4 attention sinks + the most recent tokens
            kept = torch.cat([torch.arange(4), torch.arange(length - (C - 4), length)])
            return kept.expand(layers, heads, -1)
        score, granularity = RULES[self.name]
        scores = token_scores(score, keys, values)
        if granularity == "token":
            return keep_with_edges(scores, B, B, C)
        per_token = scores.mean(dim=(0, 1))  # averaged over layers and heads
        if phase == "prefill":
            kept = keep_with_edges(per_token, B, B + length % B, C + length % B)
            return kept.expand(layers, heads, -1)
        blocks = length // B
        block_scores = rounded(per_token[: blocks * B].view(blocks, B).mean(dim=-1))
        candidates = block_scores[1 : blocks - 1]  # never the first block, never the newest
        return 1 + int(torch.nonzero(candidates == candidates.min())[0])


class PlainReference:
    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int, policy: PlainPolicy) -> tuple[list[int], dict]:
        """Greedy output ids, and how many evictions of each phase happened."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        logical, physical, out = 0, 0, []
        counts = {"prefill": 0, "decode": 0}
        step = torch.tensor([prompt])
        while len(out) < new_tokens:
            width = step.shape[1]
            logits = self.model(input_ids=step, position_ids=torch.arange(logical, logical + width)[None],
                                cache_position=torch.arange(physical, physical + width),
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            logical, physical = logical + width, physical + width
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

    @staticmethod
    def _apply(cache, policy: PlainPolicy, phase: str) -> int:
        keys = [layer.keys[0] for layer in cache.layers]
        values = [layer.values[0] for layer in cache.layers]
        kept = policy.keep(keys, values, phase)
        if isinstance(kept, int):  # a whole block leaves
            length = keys[0].shape[1]
            index = torch.cat([torch.arange(kept * policy.block), torch.arange((kept + 1) * policy.block, length)])
            kept = index.expand(len(keys), keys[0].shape[0], -1)
        for layer, layer_kept in zip(cache.layers, kept):
            gather = layer_kept[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather).contiguous()
            layer.values = layer.values.gather(2, gather).contiguous()
        return kept.shape[-1]

"""A worker's share of the KV heads under tensor parallelism, and what keeps the ranks' evictions equal.

Under tensor parallelism each rank holds a contiguous slice of every layer's KV heads (rank r of
s: heads ``[r h, (r + 1) h)`` with h = KV heads / s, and the query heads that read them), while
the scheduler and its block table are shared: it applies rank 0's ``EvictionReport`` to every
rank (only rank 0's ``ModelRunnerOutput`` reaches it, ``vllm/v1/executor/multiproc_executor.py:
355-365``). So every rank must make the same decisions.

A score's row for a KV head reads only that head's keys, values and query group
(``policies.score``), so a rank scores its own heads alone; the ranks then exchange those rows
(an all-gather, in rank order, per group of requests scored together: usually one per step that
evicts, plus one per request whose uncounted queries H2O counts outside an eviction) and every
rank holds the scores a single worker would have computed, decides exactly as it would, and
compacts its own heads' slice of each keep set. A digest of the step's decisions is then
all-gathered and compared: a rank whose state drifted stops the engine
(``RankDisagreementError``) instead of serving a cache the scheduler no longer describes. Drift
that changes what ranks exchange (how many tokens a rank scores, or whether it scores at all)
cannot be told from there: the collective itself then fails or waits, as vLLM's own would.

Nothing here imports vLLM: the engine passes the collective (``all_gather``) in.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch


class RankDisagreementError(RuntimeError):
    """Tensor-parallel ranks chose different evictions for the same step."""


@dataclass(frozen=True)
class HeadShards:
    """This worker's place among ``size`` tensor-parallel ranks. ``all_gather(x)`` concatenates
    every rank's ``x`` along dim 0 in rank order (vLLM's tensor-parallel group); a single worker
    needs none."""

    rank: int = 0
    size: int = 1
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.all_gather is None:
            raise ValueError("more than one rank needs a collective to gather scores with")

    def local(self, local_heads: int) -> slice:
        """This rank's slice of the model's KV heads, given how many it holds."""
        return slice(self.rank * local_heads, (self.rank + 1) * local_heads)

    def gather_heads(self, scores: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each ``[layers, local heads, tokens]`` score tensor as ``[layers, all heads, tokens]``:
        every rank's rows, in head order, with one collective for the whole list."""
        if self.size == 1 or not scores:
            return scores
        flat = torch.cat([s.float().permute(1, 0, 2).flatten(1) for s in scores], dim=1)  # [local heads, sum L*n]
        gathered = self.all_gather(flat.contiguous())  # [all heads, sum L*n]
        out, start = [], 0
        for s in scores:
            layers, _, tokens = s.shape
            part = gathered[:, start : start + layers * tokens]
            out.append(part.reshape(-1, layers, tokens).permute(1, 0, 2).to(s.dtype).contiguous())
            start += layers * tokens
        return out

    def check_agree(self, decisions: list[tuple], kept: list[torch.Tensor], device) -> None:
        """Stop unless every rank made these ``decisions`` (request id, kept blocks, evicted
        tokens, ...) and these full-head keep sets."""
        if self.size == 1:
            return
        digest = torch.tensor([zlib.crc32(repr(decisions).encode()), 0], dtype=torch.int64, device=device)
        for index, keep in enumerate(kept):
            flat = keep.flatten().long()
            weights = torch.arange(1, flat.numel() + 1, device=flat.device) * (2 * index + 3)
            digest[1] += (flat * weights).sum().to(device)
        every = self.all_gather(digest.view(1, 2)).cpu()
        differing = [rank for rank in range(self.size) if not torch.equal(every[rank], every[0])]
        if differing:
            raise RankDisagreementError(
                f"tensor-parallel rank(s) {differing} chose different evictions than rank 0 for requests "
                f"{sorted({d[0] for d in decisions})}: the scheduler applies rank 0's, so the other ranks' "
                "caches would no longer match it (their per-request policy state has drifted)")


SINGLE = HeadShards()

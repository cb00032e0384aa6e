"""What eviction takes beside vLLM's KV pool, predicted before any model loads.

Per request the worker keeps a policy's state between evictions (``PolicyState``): an
attention-aware policy's query window in the model's dtype, a static score's cached form or an
accumulating score's totals in float32, for at most ``budget + block_size`` tokens once the request
evicts (a request inside its budget holds fewer). On top, one step's evictions allocate scratch,
bounded by the group of requests the evictor takes at once (``predict``). With the layers as G KV
cache groups (``engine.layer_groups``) each group keeps its own state for its own layers and budget;
its evictions run one group after another, each on fewer layers, so the one-group scratch bounds them. On a
hybrid model (sliding-window layers beside full-attention ones, ``ModelShape.sliding_layers``) a
policy acts on the full-attention layers only: their scores, their query windows (the worker
copies no sliding-window layer's queries: ``harness.engine.query_capture.QueryCapture``) and their
evictions' scratch.
``experiments/eviction_cost.py --batch`` measures a full batch's step against this prediction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from policies import Policy

SCORE_BYTES = 4  # scores and totals are float32

# How many bytes of one layer's K/V the evictor reads in one gather, per device (the engine's
# backend views, harness/engine/backend_views.py, take theirs from here, so that a prediction made
# before vLLM loads uses the same figure).
JOINT_READ_BYTES = {
    # Joint reads of several requests stop paying once they outgrow the caches: measured on a
    # 2-core AVX-512 machine at SmolLM2's shape, 4 MiB groups (about 5 requests of 544 tokens) were
    # as fast as one request at a time for compaction and faster for scoring
    # (experiments/eviction_cost.py, "together" cases).
    "cpu": 4 << 20,
    # A GPU is bound by kernel launches, so requests are read together; the limit bounds the
    # eviction's scratch memory (one layer's K/V of the group, plus its gathered copy).
    "cuda": 256 << 20,
}


@dataclass(frozen=True)
class EvictionMemory:
    per_request: int   # bytes of policy state one request keeps between evictions
    requests: int      # requests at once (max_num_seqs)
    scratch: int       # bytes one step's evictions allocate on top, at most

    @property
    def total(self) -> int:
        return self.per_request * self.requests + self.scratch

    def describe(self) -> str:
        return (f"{self.total / 2**30:.2f} GiB ({self.per_request / 2**10:.1f} KiB of policy state per request x "
                f"{self.requests} requests + {self.scratch / 2**20:.0f} MiB of eviction scratch)")


def state_per_token(policy: Policy, layers: int, kv_heads: int) -> int:
    """Bytes of scores a policy keeps per cached token between evictions."""
    scored = len(policy.scored_layers(layers))
    if policy.accumulates:
        return scored * kv_heads * SCORE_BYTES  # totals stay per layer and KV head
    if policy.static_scores:
        return policy.cached_form(torch.zeros(scored, kv_heads, 1)).numel() * SCORE_BYTES
    return 0


INDEX_BYTES = 8  # keep sets and gather indices are int64
MARGIN = 1.1     # see predict


def predict(policy: Policy, shape, max_num_seqs: int, max_model_len: int,
            joint_read_bytes: int | None, groups: Sequence[Policy] = ()) -> EvictionMemory:
    """``shape``: ``harness.config.models.ModelShape`` (layers, KV and query heads, head dim, dtype bytes,
    sliding-window layers).

    Scratch is one group of requests evicted together (``harness.eviction.evictor.evict_all``): as
    many tokens as ``joint_read_bytes`` of one layer's K/V hold (at least the longest context), read
    and gathered (twice that), their scores of every layer evicted and the state built from them beside the
    old, their keep sets and gather indices (three int64 copies per layer, KV head and token); one
    request's selection temporaries (sorting its scores) and one layer's softmax over the window;
    and ``MARGIN`` for what this count leaves out (allocator rounding, short-lived copies):
    ``experiments/eviction_cost.py --batch`` measures each case within the prediction.

    ``groups``: each evicting group's policy (its own budget), when the layers run as several groups
    (``engine.layer_groups``, or a hybrid model's full-attention groups); the state per request is
    then each group's for its own layers."""
    count = max(1, len(groups))
    parts = [policy] if len(groups) <= 1 else list(groups)
    scored = shape.evicting_layers  # every layer, or a hybrid model's full-attention ones
    per_request = 0
    for part in parts:
        held = min(part.budget + part.block_size, max_model_len)
        layer_window = shape.query_heads * shape.head_dim * shape.dtype_bytes
        per_request += part.query_window * (scored // count) * layer_window
        per_request += held * state_per_token(part, scored // count, shape.kv_heads)
    layer_bytes = shape.layer_bytes_per_token  # one token's K and V in one layer
    group_tokens = max_model_len if joint_read_bytes is None else max(joint_read_bytes // layer_bytes, max_model_len)
    group_tokens = min(group_tokens, max_num_seqs * max_model_len)
    per_token = scored * shape.kv_heads * (2 * SCORE_BYTES + 3 * INDEX_BYTES)
    selection = scored * shape.kv_heads * max_model_len * (4 * SCORE_BYTES + INDEX_BYTES)
    softmax = shape.query_heads * policy.query_window * max_model_len * SCORE_BYTES
    scratch = int(MARGIN * (group_tokens * (2 * layer_bytes + per_token) + selection + softmax)) if policy.evicts else 0
    return EvictionMemory(per_request if policy.evicts else 0, max_num_seqs, scratch)

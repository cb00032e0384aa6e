"""Load: 64 concurrent requests of mixed lengths with eviction on all complete, give every block
back, and produce what each request produces alone (its neighbours do not leak into it). Half the
requests evict with ``paged`` (the engine's default) and half with ``knorm`` (each request's own
settings), so one pair of engines covers a block-wise and a token-wise policy side by side. Alone,
one request in four runs (16: eight of each policy, lengths drawn at random), which keeps the second
engine's run a quarter of the 64 one after another (CI time) and still tests every kind of neighbour."""
from __future__ import annotations

import pytest

from harness.eviction.counters import EvictionCounters
from tests.support.engine_support import assert_same_outputs, mixed_lengths, run_engine, text_prompts

pytestmark = pytest.mark.engine

BUDGET = 128


def test_64_concurrent_requests_of_two_policies_equal_the_same_requests_one_by_one(tmp_path):
    prompts = text_prompts("tiny", mixed_lengths(64, 40, 1500, seed=9), seed=9)
    default = {"policy": "paged", "budget": BUDGET}
    per_request = [None if i % 2 == 0 else {"policy": "knorm", "budget": BUDGET} for i in range(len(prompts))]
    together = run_engine(tmp_path, "tiny", prompts, 40, eviction=default, request_eviction=per_request)
    sampled = [i for i in range(len(prompts)) if i % 8 in (0, 3)]  # 8k: paged's requests, 8k + 3: knorm's
    alone = run_engine(tmp_path, "tiny", [prompts[i] for i in sampled], 40, eviction=default,
                       request_eviction=[per_request[i] for i in sampled], one_by_one=True)
    assert [len(o) for o in together["outputs"]] == [40] * 64, "every request completed"
    ledger = together["ledger"]
    assert ledger["running_requests_peak"] >= 32, "they really ran concurrently"
    assert ledger["evictions"]["prefill"] >= 40 and ledger["evictions"]["decode"] > 0
    for policy, first in (("paged", 0), ("knorm", 1)):
        counters = together["request_counters"][first::2]
        assert all(c is None or c["policy"] == policy for c in counters), f"each request evicted with its own policy ({policy})"
        mine = EvictionCounters.over(counters).evictions
        assert mine["prefill"] >= 15 and mine["decode"] > 0, (policy, mine)
    assert together["free_blocks_after"] == together["free_blocks_before"] == ledger["kv_pool_blocks"], "no block leaked"
    assert alone["ledger"]["running_requests_peak"] == 1
    assert_same_outputs(alone, {key: [together[key][i] for i in sampled] for key in ("outputs", "top_logprobs")})

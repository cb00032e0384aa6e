"""Load: 64 concurrent requests of mixed lengths with eviction on all complete, give every block
back, and produce what each request produces alone (its neighbours do not leak into it)."""
from __future__ import annotations

import pytest

from tests.support.engine_support import assert_same_outputs, mixed_lengths, run_engine, text_prompts

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("policy", ["paged", "knorm"])
def test_64_concurrent_requests_equal_the_same_requests_one_by_one(tmp_path, policy):
    prompts = text_prompts("tiny", mixed_lengths(64, 40, 1500, seed=9), seed=9)
    settings = {"policy": policy, "budget": 128}
    together = run_engine(tmp_path, "tiny", prompts, 40, eviction=settings)
    alone = run_engine(tmp_path, "tiny", prompts, 40, eviction=settings, one_by_one=True)
    assert [len(o) for o in together["outputs"]] == [40] * 64, "every request completed"
    ledger = together["ledger"]
    assert ledger["running_requests_peak"] >= 32, "they really ran concurrently"
    assert ledger["evictions"]["prefill"] >= 40 and ledger["evictions"]["decode"] > 0
    assert together["free_blocks_after"] == together["free_blocks_before"] == ledger["kv_pool_blocks"], "no block leaked"
    assert alone["ledger"]["running_requests_peak"] == 1
    assert_same_outputs(alone, together)

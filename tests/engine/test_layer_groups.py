"""The model's layers as G KV cache groups in the real engine (``engine.layer_groups``,
``harness.engine.layer_groups``): SmolLM2's 30 layers as three groups of ten, full cache, prefix
caching on. Each group reads its own block table over the same tokens, so nothing the model
computes may change: the outputs equal one group's, every request holds three times the blocks
(each a third the size), and every block comes back. Evicting on such an engine is refused with
the reason (per group is not built yet)."""
from __future__ import annotations

import pytest

from tests.support.engine_support import assert_same_outputs, mixed_lengths, run_engine, text_prompts

pytestmark = pytest.mark.engine

GROUPS = 3
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of 200-500 tokens and one that repeats the first's first 256 (a prefix hit)."""
    own = text_prompts("smollm2", mixed_lengths(3, 200, 500, seed=11), seed=11)
    return own + [own[0][:256] + own[1][:64]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prompts):
    return {groups: run_engine(tmp_path_factory.mktemp(f"g{groups}"), "smollm2", prompts, NEW_TOKENS,
                               prefix_caching=True, layer_groups=groups)
            for groups in (1, GROUPS)}


def test_three_groups_of_ten_contiguous_layers_generate_what_one_group_does(runs):
    layers = [[int(name.split(".")[2]) for name in group] for group in runs[GROUPS]["kv_cache_groups"]]
    assert layers == [list(range(g * 10, g * 10 + 10)) for g in range(GROUPS)]
    assert len(runs[1]["kv_cache_groups"]) == 1
    assert_same_outputs(runs[1], runs[GROUPS])


def test_the_same_memory_holds_three_times_the_blocks_and_every_request_three_times_as_many(runs):
    one, three = runs[1], runs[GROUPS]
    # vLLM's block counts, each its memory divided by a block's bytes rounded down (null block included)
    assert 3 * one["pool_blocks"] <= three["pool_blocks"] < 3 * one["pool_blocks"] + 3
    for figure in ("kv_blocks_used_peak", "decode_blocks_peak"):
        assert three["ledger"][figure] == GROUPS * one["ledger"][figure] > 0, figure
    for run in (one, three):
        assert run["free_blocks_after"] == run["free_blocks_before"], "every block returns"


def test_a_request_that_asks_to_evict_is_refused_with_the_reason(tmp_path, prompts):
    with pytest.raises(RuntimeError, match="layer_groups=3 KV cache groups, which runs full cache only so far"):
        run_engine(tmp_path, "smollm2", prompts[:1], 4, layer_groups=GROUPS,
                   request_eviction=[{"policy": "paged", "budget": 128}])

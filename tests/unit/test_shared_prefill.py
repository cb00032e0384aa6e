"""Grouping a sweep's cells and admitting prompts to a shared engine (no engine started)."""
from __future__ import annotations

from types import SimpleNamespace

from hydra import compose, initialize_config_dir

from harness.eviction.settings import EvictionSettings
from harness.engine.shared_prefill import CellRequest, admission, blocks_per_prompt
from harness.config import run_settings
from harness.run.group import group_key
from policies import default_options
from tests.support import ROOT

CONF_DIR = ROOT / "conf"


def cell(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run_settings(compose(config_name="config", overrides=list(overrides)))


def test_cells_differing_in_policy_and_budget_share_an_engine():
    paged, knorm, full = cell("policy=paged", "budget=256"), cell("policy=knorm", "budget=512"), cell("policy=full")
    assert group_key(paged) == group_key(knorm) == group_key(full)
    assert group_key(cell("policy=paged", "data.limit=2")) != group_key(paged)
    assert group_key(cell("policy=paged", "model=tiny")) != group_key(paged)
    assert full.eviction is None
    assert knorm.eviction == EvictionSettings("knorm", 512, default_options("knorm"))


def test_a_prompt_holds_its_shared_blocks_once_and_each_requests_own():
    full = CellRequest(None, 64)
    paged = CellRequest(EvictionSettings("paged", 256), 64)
    # 1000 tokens = 32 shared blocks; full cache adds its 64 generated tokens (2 blocks + 1);
    # an evicting request holds budget + block + 64 new (11 blocks), twice for the copies, + 1.
    assert blocks_per_prompt(1000, [full], 32) == 32 + 3
    assert blocks_per_prompt(1000, [full, paged], 32) == 32 + 3 + 23


def test_prompts_are_admitted_while_their_blocks_and_requests_fit():
    engine = SimpleNamespace(
        facts=lambda: {"block_size": 32, "kv_pool_blocks": 100, "layer_groups": 1},
        llm=SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=4)))),
    )
    prompts = [[0] * 1000, [0] * 1000, [0] * 3000, [0] * 100]
    cells = [[CellRequest(None, 64), CellRequest(EvictionSettings("paged", 256), 64)]] * 4
    admits = admission(engine, prompts, cells)
    # Blocks per prompt: 58, 58, 120, 20 (shared prompt, full cache's own, paged's own with copies).
    assert admits(2, [])             # the first prompt always starts, whatever its size
    assert not admits(1, [0])        # 58 + 58 blocks > 100
    assert admits(3, [0])            # 58 + 20 blocks, four requests
    assert not admits(3, [3, 3])     # 60 blocks, but six requests > max_num_seqs = 4


def test_a_cells_counters_are_the_sum_of_its_requests_beside_the_engines_shared_figures():
    from harness.eviction.counters import EvictionCounters, RequestCounters
    from harness.eviction.evictor import Eviction
    from harness.run.group import cell_kv

    first, second = RequestCounters(policy="paged", budget=256), RequestCounters(policy="paged", budget=256)
    first.record(Eviction("prefill", (0, 1, 2), 6, evicted_tokens=96, copied_tokens=40, seconds=0.5),
                 released_blocks=4, copy_target_blocks=1)
    first.record(Eviction("decode", (0, 2), 3, evicted_tokens=32, copied_tokens=0, seconds=0.25),
                 released_blocks=1, copy_target_blocks=0)
    second.record(Eviction("prefill", (0, 1), 2, evicted_tokens=0, copied_tokens=0, seconds=0.125),
                  released_blocks=0, copy_target_blocks=0)  # nothing evicted: only its time counts
    engine_ledger = {"kv_pool_blocks": 100, "steps": 7, "evictions": {"prefill": 9, "decode": 9}, "evict_s": 9.0}
    counted = cell_kv(engine_ledger, cell("policy=paged", "budget=256"),
                   [first.as_dict(), None, second.as_dict()])
    assert counted["evictions"] == {"prefill": 1, "decode": 1} and counted["freed_blocks"] == 3 + 1
    assert counted["evicted_tokens"] == 128 and counted["copied_tokens"] == {"prefill": 40, "decode": 0}
    assert counted["copy_target_blocks"] == 1 and counted["evict_s"] == 0.875
    assert counted["kv_pool_blocks"] == 100 and counted["steps"] == 7 and "steps" in counted["shared_figures"]
    assert counted["policy"] == "paged" and counted["budget"] == 256
    assert not any(key.startswith("reconstruct") for key in counted["shared_figures"])
    # KVzip's passes are counted per engine step, not per request: the group's figures, named so
    with_passes = cell_kv({**engine_ledger, "reconstruct_s": 3.5, "reconstruct_tokens": 900, "reconstruct_reused": 2},
                          cell("policy=paged", "budget=256"), [first.as_dict()])
    assert with_passes["reconstruct_tokens"] == 900
    assert {"reconstruct_s", "reconstruct_tokens", "reconstruct_reused"} <= set(with_passes["shared_figures"])
    assert EvictionCounters.of(first.as_dict()).counts() == {k: v for k, v in first.as_dict().items()
                                                             if k not in ("policy", "budget")}

"""Grouping a sweep's cells and admitting prompts to a shared engine (no engine started)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from hydra import compose, initialize_config_dir

from harness.engine.settings import EvictionSettings
from harness.engine.shared_prefill import CellRequest, admission, blocks_per_prompt
from harness.group import eviction_of, group_key


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def cell(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_cells_differing_in_policy_and_budget_share_an_engine():
    paged, knorm, full = cell("policy=paged", "budget=256"), cell("policy=knorm", "budget=512"), cell("policy=full")
    assert group_key(paged) == group_key(knorm) == group_key(full)
    assert group_key(cell("policy=paged", "data.limit=2")) != group_key(paged)
    assert group_key(cell("policy=paged", "model=tiny")) != group_key(paged)
    assert eviction_of(full) is None
    assert eviction_of(knorm) == EvictionSettings("knorm", 512, dict(knorm.policy.options or {}))


def test_a_prompt_holds_its_shared_blocks_once_and_each_requests_own():
    full = CellRequest(None, 64)
    paged = CellRequest(EvictionSettings("paged", 256), 64)
    # 1000 tokens = 32 shared blocks; full cache adds its 64 generated tokens (2 blocks + 1);
    # an evicting request holds budget + block + 64 new (11 blocks), twice for the copies, + 1.
    assert blocks_per_prompt(1000, [full], 32) == 32 + 3
    assert blocks_per_prompt(1000, [full, paged], 32) == 32 + 3 + 23


def test_prompts_are_admitted_while_their_blocks_and_requests_fit():
    engine = SimpleNamespace(
        facts=lambda: {"block_size": 32, "kv_pool_blocks": 100},
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

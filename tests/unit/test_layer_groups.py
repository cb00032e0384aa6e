"""The layers as G KV cache groups (``harness.engine.layer_groups``), without an engine: vLLM's own
grouping (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``) run on the specs the
harness tags, and the refusals before any model loads. The engine itself: tests/engine/test_layer_groups.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from harness.config import ConfigError, run_settings
from harness.engine.compatibility import layer_groups_of
from harness.eviction.settings import check_schedule_runs, group_policies, parse_settings
from policies import make_policy
from harness.engine.layer_groups import BudgetGroupSpec, check_engine, tag_specs
from tests.unit.test_config import compose_cfg

SPEC = dict(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.float32)


def specs(layers: int, kind=FullAttentionSpec, **extra) -> dict:
    """One spec per layer, named as vLLM names a Llama's attention layers, out of order."""
    return {f"model.layers.{i}.self_attn.attn": kind(**SPEC, **extra) for i in reversed(range(layers))}


def vllm_config(groups: int = 1, disable_hybrid: bool = False, blocks: int | None = None):
    """What vLLM's grouping reads of its config (the fields design/layer_groups_checks use)."""
    return SimpleNamespace(
        additional_config={"kv_layer_groups": groups} if groups != 1 else {},
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=disable_hybrid),
        speculative_config=None, attention_config=SimpleNamespace(hisparse_config=None), model_config=None,
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: kv_cache_utils.KVCacheLayout.LBHNC,
                                     num_gpu_blocks_override=blocks, prefix_cache_retention_interval=None))


def layers_of(group) -> list[int]:
    return [int(name.split(".")[2]) for name in group.layer_names]


@pytest.mark.parametrize("groups", [2, 3, 5, 6, 10, 15, 30])
def test_vllm_forms_one_kv_cache_group_per_budget_group_of_contiguous_layers(groups):
    found = kv_cache_utils.get_kv_cache_groups(vllm_config(groups), tag_specs(specs(30), groups))
    size = 30 // groups
    assert [layers_of(group) for group in found] == [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    assert [group.kv_cache_spec.budget_group for group in found] == list(range(groups))


def test_one_group_is_vllms_own_spec_and_grouping():
    found = kv_cache_utils.get_kv_cache_groups(vllm_config(), specs(30))
    assert len(found) == 1 and type(found[0].kv_cache_spec) is FullAttentionSpec


def test_a_block_holds_one_groups_layers_so_the_same_memory_holds_g_times_the_blocks():
    """Three tensors over one buffer (a block id belongs to one group at a time), each of 10 layers'
    pages: 3x the blocks of one 30-layer group in the same bytes."""
    memory = 64 * 2**20
    one = kv_cache_utils.get_kv_cache_config_from_groups(
        vllm_config(), kv_cache_utils.get_kv_cache_groups(vllm_config(), specs(30)), memory)
    three = kv_cache_utils.get_kv_cache_config_from_groups(
        vllm_config(3), kv_cache_utils.get_kv_cache_groups(vllm_config(3), tag_specs(specs(30), 3)), memory)
    assert 3 * one.num_blocks <= three.num_blocks < 3 * (one.num_blocks + 1)  # each rounded down on its own
    # One tensor per group, all from offset 0 of the same bytes (vllm/v1/worker/utils.py:574, "Cache
    # groups overlay each other"), each holding its 10 layers.
    tensors = three.kv_cache_tensors
    assert [t.offset for t in tensors] == [0, 0, 0] and len({t.size for t in tensors}) == 1
    assert [len(t.layers) for t in tensors] == [10, 10, 10]


def test_merging_keeps_the_tag_and_refuses_two_groups():
    a, b = BudgetGroupSpec(**SPEC, budget_group=1), BudgetGroupSpec(**SPEC, budget_group=2)
    assert BudgetGroupSpec.merge([a, a]).budget_group == 1
    with pytest.raises(AssertionError, match="budget groups"):
        BudgetGroupSpec.merge([a, b])
    assert not a.is_uniform_with_collection({"x": a, "y": b}) and a.is_uniform_with_collection({"x": a})


def test_layer_counts_groups_do_not_divide_and_other_attention_types_are_refused():
    with pytest.raises(ValueError, match="layer_groups=4 does not divide the model's 30 attention layers"):
        tag_specs(specs(30), 4)
    with pytest.raises(ValueError, match="every attention layer is full attention; this one also has SlidingWindowSpec"):
        tag_specs({**specs(4), "model.layers.4.self_attn.attn": SlidingWindowSpec(**SPEC, sliding_window=64)}, 5)
    with pytest.raises(ValueError, match="sliding-window layers"):
        tag_specs(specs(4, sliding_window=64), 2)
    with pytest.raises(ValueError, match="needs vLLM's hybrid KV cache manager"):
        check_engine(vllm_config(2, disable_hybrid=True))
    check_engine(vllm_config(1, disable_hybrid=True))  # one group needs nothing of it


def test_what_a_policy_cannot_do_per_group_is_refused_with_the_reason():
    assert layer_groups_of(vllm_config(3)) == 3 and layer_groups_of(vllm_config()) == 1
    for raw, message in [
        ({"policy": "paged", "budget": 512, "options": {"score_layers": 2}}, "score_layers names one layer"),
    ]:
        with pytest.raises(ValueError, match=message):
            group_policies(parse_settings(raw, "test"), 32, 30, 3)
    with pytest.raises(ValueError, match="budget_schedule=pyramid spreads the budget over the engine's layer groups; "
                                         "this engine has one"):
        group_policies(parse_settings({"policy": "paged", "budget": 512, "budget_schedule": "pyramid"}, "t"), 32, 30, 1)
    with pytest.raises(ValueError, match="budget_schedule must be one of uniform, pyramid, attention, kvzip, "
                                         "got 'cake'"):
        parse_settings({"policy": "paged", "budget": 512, "budget_schedule": "cake"}, "test")
    attention = parse_settings({"policy": "paged", "budget": 512, "budget_schedule": "attention"}, "test")
    assert attention.measuring and [p.budget for p in group_policies(attention, 32, 30, 3)] == [512] * 3  # until measured
    measured = attention.with_preferences([3.0] * 10 + [2.0] * 10 + [1.0] * 10, 32, 30, 3)
    assert not measured.measuring and measured.group_budgets == (768, 512, 256) and measured.key != attention.key
    assert [p.budget for p in group_policies(measured, 32, 30, 3)] == [768, 512, 256]
    with pytest.raises(ValueError, match="synchronous scheduling"):
        check_schedule_runs(attention, enforce_eager=True, async_scheduling=True)
    with pytest.raises(ValueError, match="enforce_eager"):
        check_schedule_runs(attention, enforce_eager=False, async_scheduling=False)
    check_schedule_runs(attention, enforce_eager=True, async_scheduling=False)
    with pytest.raises(ValueError, match="pyramid_beta shapes budget_schedule=pyramid"):
        parse_settings({"policy": "paged", "budget": 512, "pyramid_beta": 5}, "test")
    pyramid = group_policies(parse_settings({"policy": "paged", "budget": 512, "budget_schedule": "pyramid"}, "t"), 32, 30, 3)
    assert [policy.budget for policy in pyramid] == [832, 512, 192]  # 3 x 512 in whole blocks, more below
    floor = group_policies(parse_settings({"policy": "paged", "budget": 64, "budget_schedule": "pyramid"}, "t"), 32, 30, 3)
    assert [policy.budget for policy in floor] == [64, 64, 64]  # at least two blocks per group
    # SnapKV's window (its last 32 tokens' queries, with a block of them kept) needs more than two blocks of 16
    snapkv = parse_settings({"policy": "snapkv", "budget": 64, "budget_schedule": "pyramid"}, "t")
    least = min(policy.budget for policy in group_policies(snapkv, 16, 30, 3))
    with pytest.raises(ValueError):
        make_policy("snapkv", least - 16, 16)


def test_the_run_config_checks_layer_groups_before_any_model_loads():
    run = run_settings(compose_cfg("engine.layer_groups=3"))
    assert run.engine.layer_groups == 3
    assert run.cell_name != run_settings(compose_cfg()).cell_name, "G > 1 is another cell"
    assert "layer_groups" not in run_settings(compose_cfg()).identity()["engine"], "G = 1 keeps committed names"
    pyramid = run_settings(compose_cfg("engine.layer_groups=3", "policy=paged", "budget=512", "budget_schedule=pyramid"))
    assert pyramid.eviction.budget_schedule == "pyramid" and pyramid.cell_name.startswith("paged_b512_pyramid_bs32_")
    assert "budget_schedule" not in run_settings(compose_cfg("policy=paged", "budget=512")).identity()
    attention = run_settings(compose_cfg("engine.layer_groups=3", "policy=snapkv", "budget=512", "budget_schedule=attention"))
    assert attention.cell_name.startswith("snapkv_b512_attention_bs32_")  # on CPU: synchronous, eager
    gpu = ("engine.layer_groups=3", "policy=paged", "budget=512", "budget_schedule=attention", "engine.device=cuda", "block_size=16",
           "model.dtype=bfloat16")
    assert run_settings(compose_cfg(*gpu, "engine.async_scheduling=false")).eviction.budget_schedule == "attention"
    for overrides, message in [
        (["engine.layer_groups=7"], "engine.layer_groups=7 does not divide the model's 30 attention layers"),
        (["engine.layer_groups=0"], "engine.layer_groups must be a positive integer, got 0"),
        (["engine.layer_groups=3", "policy=paged", "budget=512", "policy.options.score_layers=0"],
         "score_layers names one layer"),
        (["policy=paged", "budget=512", "budget_schedule=pyramid"], "budget_schedule=pyramid spreads the budget"),
        (["policy=paged", "budget=512", "budget_schedule=steep"], "budget_schedule must be one of uniform, pyramid"),
        (["engine.layer_groups=3", "policy=paged", "budget=512", "budget_schedule=attention", "engine.device=cuda",
          "block_size=16", "model.dtype=bfloat16"], "an asynchronous scheduler plans the next step"),
        (["engine.layer_groups=3", "policy=paged", "budget=512", "budget_schedule=attention",
          "engine.enforce_eager=false"], "budget_schedule=attention reads the prompt's queries"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            run_settings(compose_cfg(*overrides))


def test_the_pool_check_counts_g_blocks_per_token_slot():
    """A pool holds the same tokens at any G, in G times the blocks of 1/G the layers (as vLLM divides
    the memory: 218 blocks where G = 1 has 72, each a third of the size); too small a pool says so in
    the blocks each group's share of one request needs (256 at G = 1)."""
    with pytest.raises(ConfigError, match=r"kv_cache_gib=0.1 \(218 blocks of 32 tokens\) holds 218 blocks, each of one KV "
                                          r"cache group's 10 layers, but one request .* may need max_model_len=8192 "
                                          r"tokens \(768 blocks: 256 in each of its 3 full-attention groups; and vLLM keeps "
                                          r"one block back\): raise engine.kv_cache_gib to at least 0.353"):
        run_settings(compose_cfg("engine.kv_cache_gib=0.1", "engine.layer_groups=3"))

"""Eviction on a hybrid-attention model (sliding-window layers beside full-attention ones, like
Gemma 3), scheduler side (issue 66): no model, the real ``EvictionScheduler`` on vLLM's real
``HybridKVCacheCoordinator`` and block pool, the KV cache groups vLLM gives the tiny hybrid test model
(``tiny-gemma3``: two sliding-window groups, one full-attention group, two layers each), and the
fake worker of ``test_async_scheduling`` running the harness's real evictor.

Eviction acts on the full-attention group only; the sliding-window groups stay vLLM's: never
evicted, never reshaped, their blocks freed by vLLM's ``SlidingWindowManager`` as the window moves."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tests.unit.test_async_scheduling as fake
from harness.eviction.settings import CONFIG_KEY
from tests.unit.test_async_scheduling import BLOCK, DIM, HEADS, LAYERS, OUTPUTS, POOL, PROMPTS, Worker, drive

WINDOW = 8  # tokens: two blocks, so every prompt here (9 to 61 tokens) leaves it
# tiny-gemma3's groups as vLLM forms them (checked against vLLM below): layers 0 and 3, 1 and 4 slide; 2 and 5 global
GROUP_LAYERS = ([0, 3], [1, 4], [2, 5])
FULL_GROUP = 2


def specs(window: int = WINDOW):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    shape = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)
    return [SlidingWindowSpec(**shape, sliding_window=window), SlidingWindowSpec(**shape, sliding_window=window),
            FullAttentionSpec(**shape)]


def make_hybrid_scheduler(asynchronous: bool, pool: int = POOL, prefix_caching: bool = False, default=None,
                          model: str = "tiny-gemma3", group_specs=None, hybrid_manager=True):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from harness.config.models import EMBEDDED_PREFIX, resolve_model_path
    from harness.engine.compatibility import SCHEDULER_CLS
    from harness.engine.scheduler import EvictionScheduler

    # (the scheduler reads the model config for enforce_eager, the context length and its layer types)
    model_config = ModelConfig(model=resolve_model_path(EMBEDDED_PREFIX + model), max_model_len=256, dtype="float32",
                               enforce_eager=True)
    additional = {CONFIG_KEY: default} if default is not None else {}
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=256,
                                         is_encoder_decoder=False, scheduler_cls=SCHEDULER_CLS,
                                         disable_hybrid_kv_cache_manager=not hybrid_manager),
        additional_config=additional,
    )
    config.scheduler_config.async_scheduling = asynchronous  # (as test_async_scheduling sets it)
    config.cache_config.num_gpu_blocks = pool
    kv_cache = KVCacheConfig(num_blocks=pool, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{layer}.attn" for layer in layers], spec)
        for layers, spec in (group_specs or zip(GROUP_LAYERS, specs()))])
    return EvictionScheduler(vllm_config=config, kv_cache_config=kv_cache,
                             structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


def test_vllm_groups_the_tiny_hybrid_model_into_sliding_window_groups_and_one_full_attention_group():
    """vLLM's own grouping (``get_kv_cache_groups``, vllm/v1/core/kv_cache_utils.py:2159) of the
    test model's layers, as its attention layers declare them (``layer_types``, ``sliding_window``
    of its config: Gemma 3's attention makes a ``SlidingWindowSpec`` of each sliding layer)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from harness.config.models import EMBEDDED_PREFIX, TINY_HYBRID, TINY_HYBRID_WINDOW, resolve_model_path

    model = json.loads((Path(resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID)) / "config.json").read_text())
    assert model["architectures"] == ["Gemma3ForCausalLM"] and model["sliding_window"] == TINY_HYBRID_WINDOW
    shape = dict(block_size=32, num_kv_heads=model["num_key_value_heads"], head_size=model["head_dim"],
                 dtype=torch.float32)
    layer_specs = {
        f"model.layers.{index}.self_attn.attn":
            SlidingWindowSpec(**shape, sliding_window=model["sliding_window"]) if kind == "sliding_attention"
            else FullAttentionSpec(**shape)
        for index, kind in enumerate(model["layer_types"])}
    config = make_hybrid_scheduler(False).vllm_config
    # the layout the CPU engine resolves (its log: "Using LBHNC KV cache layout"); the engine core
    # resolves it before grouping (vllm/v1/attention/backends/utils.py:259-280)
    config.cache_config.kv_cache_layout = "LBHNC"
    groups = get_kv_cache_groups(config, layer_specs)
    kinds = [(type(group.kv_cache_spec).__name__, [int(name.split(".")[2]) for name in group.layer_names])
             for group in groups]
    assert kinds == [("SlidingWindowSpec", [0, 3]), ("SlidingWindowSpec", [1, 4]), ("FullAttentionSpec", [2, 5])]


def hybrid_policies(settings, block_size, num_layers, groups):
    """The fake worker's policies on the hybrid groups: what the real worker must ask
    (``harness.engine.layer_groups.policies_by_group``), in place of ``group_policies``."""
    from harness.engine.layer_groups import policies_by_group

    assert groups == len(GROUP_LAYERS)
    return policies_by_group(settings, block_size, [(spec, len(layers)) for spec, layers in zip(specs(), GROUP_LAYERS)],
                             enforce_eager=True, async_scheduling=False)


def run_hybrid(monkeypatch, asynchronous: bool, settings: dict, pool: int = POOL) -> tuple[dict, dict]:
    """Every request to the end on the hybrid scheduler; what each request's global group held at its
    end, and counts. Checked on the way: the sliding-window groups are never evicted, their block
    lists are vLLM's (equal to the worker's), and they hold no more than the window's blocks."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from harness.engine.scheduler import PhysicalLengthManager

    monkeypatch.setattr(fake, "group_policies", hybrid_policies)
    scheduler, worker = make_hybrid_scheduler(asynchronous, pool), Worker(pool, len(GROUP_LAYERS))
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [type(m) for m in managers] == [SlidingWindowManager, SlidingWindowManager, PhysicalLengthManager]
    fake.add_requests(scheduler, settings)
    seen = {"sliding_blocks_peak": 0}

    def check(queue):
        for request_id, counts in scheduler.kv_ledger.evicted.items():
            assert counts[0] == counts[1] == 0, f"{request_id}: a sliding-window group evicted {counts}"
        if queue or scheduler.kv_expected:
            return
        for group, manager in enumerate(managers):
            for request in scheduler.running:
                blocks = manager.req_to_blocks[request.request_id]
                held = worker.requests[request.request_id]["blocks"][group]
                # (where vLLM put the null block in place of a block that left the window, the worker's
                # table keeps the old id, which its attention never reads: vLLM tells it only new blocks)
                assert len(blocks) == len(held) and all(
                    b.block_id == h for b, h in zip(blocks, held) if not b.is_null), (request.request_id, group)
                if group != FULL_GROUP:
                    live = sum(not block.is_null for block in blocks)
                    seen["sliding_blocks_peak"] = max(seen["sliding_blocks_peak"], live)

    steps = drive(scheduler, worker, asynchronous, after_update=check)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == pool - 1  # all back
    assert not scheduler.kv_expected and not scheduler.kv_ledger.evicted
    return ({request_id: groups[FULL_GROUP] for request_id, groups in worker.kept.items()},
            {"steps": steps, "evictions": scheduler.kv_ledger.totals.counts()["evictions"], **seen})


def positions_of(kept: torch.Tensor, request_id: str, first_layer: int) -> list[int]:
    """The logical positions of a group's kept rows: the fake worker's K/V is a function of
    (request, position, layer), so each row names its position."""
    return [next(p for p in range(256) if torch.equal(row, fake.kv(request_id, p, first_layer))) for row in kept[0]]


@pytest.mark.parametrize("settings", [{"policy": "paged", "budget": 16}, {"policy": "knorm", "budget": 12},
                                      {"policy": "streaming", "budget": 16},
                                      {"policy": "paged", "budget": 8, "decode_eviction": False}],
                         ids=["paged", "knorm", "streaming", "paged-prompt-only"])
def test_the_global_group_evicts_as_the_policy_says_and_the_sliding_groups_stay_vllms(monkeypatch, settings):
    synchronous, counts = run_hybrid(monkeypatch, False, settings)
    late, _ = run_hybrid(monkeypatch, True, settings)
    assert sum(counts["evictions"].values()) >= 4  # every prompt past its budget evicted
    # vLLM freed what left the window: a sliding-window group never held more than the window's
    # blocks and the step's (vllm/v1/kv_cache_interface.py:859-885), though the prompts reach 61 tokens
    assert 0 < counts["sliding_blocks_peak"] <= -(-(WINDOW - 1 + 48) // BLOCK) + 1
    for index, request_id in enumerate(sorted(synchronous)):
        assert torch.equal(synchronous[request_id], late[request_id]), request_id
        written = PROMPTS[index] + OUTPUTS[index] - 1
        kept = synchronous[request_id].shape[1]
        if settings.get("decode_eviction") is False:
            from policies import make_policy
            assert kept == make_policy(settings["policy"], settings["budget"], BLOCK).prefill_keep_count(
                PROMPTS[index]) + OUTPUTS[index] - 1
        else:
            assert kept <= settings["budget"] + BLOCK and (kept < written or written <= settings["budget"] + BLOCK)


def test_streaming_keeps_the_same_positions_in_the_global_group_as_on_a_model_without_windows(monkeypatch):
    """StreamingLLM chooses by position alone, so the hybrid model's global group must keep exactly
    the positions the same requests keep on an all-full-attention engine of one group."""
    settings = {"policy": "streaming", "budget": 16}
    plain, _ = fake.run(False, settings)  # (before run_hybrid replaces the fake worker's policies)
    hybrid, _ = run_hybrid(monkeypatch, False, settings)
    for request_id in plain:
        want = positions_of(plain[request_id][0], request_id, 0)
        got = positions_of(hybrid[request_id], request_id, FULL_GROUP * LAYERS)
        assert got == want, request_id


@pytest.mark.parametrize("settings, refused", [
    ({"policy": "paged", "budget": 16, "budget_schedule": "pyramid"}, "budget_schedule=pyramid on a model with"),
    ({"policy": "paged", "budget": 8, "decode_eviction": False, "compress": "context", "context_tokens": 20,
      "share_context": True}, "sharing a compressed context"),
])
def test_what_a_hybrid_model_cannot_run_yet_is_refused_in_one_line(settings, refused):
    """A request the engine cannot run on a hybrid model ends with an error and the reason; the
    engine goes on (``test_request_refusals``). An engine default that cannot run stops the engine
    at start, with the same line."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    scheduler = make_hybrid_scheduler(False)
    params = SamplingParams(max_tokens=3, ignore_eos=True, extra_args={CONFIG_KEY: settings})
    scheduler.add_request(Request("r1", [100] * 37, params, None))
    [(_, message)] = [(request.request_id, text) for request, text in scheduler.kv_refused]
    assert refused in message and "\n" not in message
    with pytest.raises(ValueError, match=refused):
        make_hybrid_scheduler(False, default=settings)


def test_a_compressed_context_runs_unshared_on_a_hybrid_model():
    """compress=context without share_context=true runs, unshared (the reason: the model's windows)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    scheduler = make_hybrid_scheduler(False, prefix_caching=True)
    assert scheduler.kv_contexts is None
    settings = {"policy": "paged", "budget": 8, "decode_eviction": False, "compress": "context", "context_tokens": 20}
    params = SamplingParams(max_tokens=3, ignore_eos=True, extra_args={CONFIG_KEY: settings})
    request = Request("r1", [100] * 37, params, None)
    scheduler.add_request(request)
    assert not scheduler.kv_refused and "r1" in scheduler.kv_request_settings
    assert scheduler.unshared_reason(request, scheduler.kv_request_settings["r1"]) == "the model has sliding-window layers"


def test_the_sliding_window_layers_are_read_from_the_models_config_before_any_model_loads():
    """What the frontend and a run's config check can ask without the KV cache groups."""
    from vllm.config import ModelConfig

    from harness.config.models import EMBEDDED_PREFIX, TINY_HYBRID, resolve_model_path
    from harness.engine.layer_groups import sliding_window_layers

    def config(name):
        return ModelConfig(model=resolve_model_path(EMBEDDED_PREFIX + name), max_model_len=256, dtype="float32")

    assert sliding_window_layers(config(TINY_HYBRID)) == [0, 1, 3, 4]
    assert sliding_window_layers(config("tiny-llama")) == []


def test_an_engine_whose_every_group_is_full_attention_gets_the_admissions_policies_unchanged():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from harness.engine.layer_groups import policies_by_group
    from harness.eviction.settings import admit, parse_settings

    settings = parse_settings({"policy": "paged", "budget": 64, "budget_schedule": "pyramid"}, "test")
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)
    assert policies_by_group(settings, BLOCK, [(full, 2)] * 3, enforce_eager=True, async_scheduling=False) == \
        admit(settings, BLOCK, 6, 3, enforce_eager=True, async_scheduling=False)


def test_without_vllms_hybrid_manager_a_hybrid_model_is_refused():
    """vLLM then puts the sliding-window layers in one group with the global ones, as full attention
    with a window: eviction would evict them too. The engine says why instead."""
    from harness.config.models import TINY_HYBRID

    spec = specs()[FULL_GROUP]
    scheduler = make_hybrid_scheduler(False, model=TINY_HYBRID, hybrid_manager=False,
                                      group_specs=[(range(6), spec)])
    assert "vLLM's hybrid KV cache manager is off" in scheduler.kv_unsupported
    assert make_hybrid_scheduler(False).kv_unsupported is None  # with it: runs

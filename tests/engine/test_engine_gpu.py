"""The same plugin on NVIDIA GPUs (vLLM 0.32, FlashAttention, V1 model runner, block size 16).

Skipped without a CUDA device: nothing here has run on a GPU yet (see the issue notes). What a GPU
run must check, on one engine per configuration with every policy x granularity of the registry
(``tests/support/policy_matrix.py``) as per-request settings in one batch:

* eager mode (every policy) and CUDA graphs (the attention-free ones; attention-aware policies
  read queries through hooks that graphs skip, and are refused there);
* asynchronous scheduling (vLLM's GPU default: eviction reports come a step late,
  ``AsyncEvictionScheduler``) and synchronous;
* prefix caching off and on (on: every prompt's blocks are registered first, and no block still
  registered under the same hash may change);
* prompts longer than three prefill chunks (``max_num_batched_tokens`` 512);
* SmolLM2 (9 query / 3 KV heads) and, when ``KVH_GPU_GQA_MODEL`` names a local 32/8 GQA checkpoint
  (Llama-3.2-1B, Llama-3.1-8B), that model too;
* every block back in the pool, and the policy state the worker held within its prediction.

The oracle is the Hugging Face reference in bfloat16 on the same GPU. Two bf16 implementations
round differently (8-bit mantissa: logits of ~20 move by ~0.1), so a parting counts as a tie within
BF16_TIE_NATS instead of fp32's 1e-3.
"""
from __future__ import annotations

import os

import pytest
import torch

from policies import REGISTRY, make_policy
from tests.support.engine_support import assert_same_outputs, model_path, run_engine
from tests.support.policy_matrix import MATRIX

pytestmark = [
    pytest.mark.engine,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with vllm==0.32.0"),
]
BF16_TIE_NATS = 0.15
BLOCK, BUDGET, NEW, CHUNK = 16, 256, 64, 512
GQA_MODEL = os.environ.get("KVH_GPU_GQA_MODEL")
MODELS = ["smollm2"] + (["gqa"] if GQA_MODEL else [])


def checkpoint(model: str) -> str:
    return GQA_MODEL if model == "gqa" else model_path(model)


def prompts_for(model: str) -> list[list[int]]:
    from harness.tasks.embedded.token_prompts import token_prompts

    return token_prompts(checkpoint(model), [1700, 2100], seed=4)  # 4 and 5 chunks of 512


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("asynchronous", [True, False], ids=["async_scheduling", "sync_scheduling"])
def test_every_policy_on_the_gpu_equals_the_bf16_reference(tmp_path, model, prefix_caching, eager, asynchronous):
    from harness.eviction.hf_reference import HFReferenceEngine
    from harness.eviction.memory import predict
    from harness.config.models import model_shape

    cases = [(name, options) for name, options in MATRIX if eager or not REGISTRY[name].reads_attention]
    prompts = prompts_for(model)
    settings = [{"policy": name, "budget": BUDGET, "options": options} for name, options in cases for _ in prompts]
    run = run_engine(tmp_path, "smollm2", prompts * len(cases), NEW, model_path=checkpoint(model), device="cuda",
                     dtype="bfloat16", block_size=BLOCK, max_model_len=4096, kv_cache_gib=None,
                     gpu_memory_utilization=0.5, in_process=True, enforce_eager=eager,
                     max_num_batched_tokens=CHUNK, prefix_caching=prefix_caching, warm_cache=prefix_caching,
                     request_eviction=settings, async_scheduling=asynchronous)
    machine = run["perf"][0]["machine"]
    assert machine["compilation"] == ("NONE" if eager else "VLLM_COMPILE")
    assert machine["async_scheduling"] is asynchronous
    ledger = run["ledger"]
    assert ledger["evictions"]["prefill"] == len(settings) and ledger["evictions"]["decode"] > 0
    assert run["free_blocks_after"] == run["free_blocks_before"] == ledger["kv_pool_blocks"]
    if prefix_caching:
        assert run["cached_blocks"]["still_registered"] > 0 and run["cached_blocks"]["changed"] == 0

    shape = model_shape(checkpoint(model), "bfloat16")
    predicted = sum(predict(make_policy(name, BUDGET, BLOCK, **options), shape, 1, 4096, None).per_request
                    for name, options in cases for _ in prompts)
    assert 0 < ledger["policy_state_bytes_peak"] <= predicted

    expected = {"outputs": [], "top_logprobs": []}
    for name, options in cases:
        reference = HFReferenceEngine(checkpoint(model), make_policy(name, BUDGET, BLOCK, **options),
                                      dtype=torch.bfloat16, device="cuda")
        for prompt in prompts:
            ids, top = reference.generate_with_top_logprobs(prompt, NEW)
            expected["outputs"].append(ids)
            expected["top_logprobs"].append(top)
        del reference
        torch.cuda.empty_cache()
    assert_same_outputs(expected, run, tie_nats=BF16_TIE_NATS)


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not GQA_MODEL,
                    reason="needs two GPUs and KVH_GPU_GQA_MODEL (a model whose heads split over two ranks)")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda_graphs"])
def test_every_policy_on_two_gpus_equals_one(tmp_path, eager):
    """Tensor parallelism over NCCL (the CPU tests run it over gloo and shared memory): the GQA
    model split over two GPUs generates what one GPU generates, for every policy x granularity."""
    cases = [(name, options) for name, options in MATRIX if eager or not REGISTRY[name].reads_attention]
    prompts = prompts_for("gqa")
    settings = [{"policy": name, "budget": BUDGET, "options": options} for name, options in cases for _ in prompts]
    runs = [run_engine(tmp_path / f"tp{size}", "smollm2", prompts * len(cases), NEW, model_path=GQA_MODEL,
                       device="cuda", dtype="bfloat16", block_size=BLOCK, max_model_len=4096, kv_cache_gib=None,
                       gpu_memory_utilization=0.5, in_process=False, enforce_eager=eager,
                       max_num_batched_tokens=CHUNK, request_eviction=settings, tensor_parallel_size=size)
            for size in (1, 2)]
    assert runs[1]["perf"][0]["machine"]["tensor_parallel_size"] == 2
    assert runs[1]["ledger"]["evictions"] == runs[0]["ledger"]["evictions"]
    assert runs[1]["free_blocks_after"] == runs[1]["free_blocks_before"]
    assert_same_outputs(runs[0], runs[1], tie_nats=BF16_TIE_NATS)

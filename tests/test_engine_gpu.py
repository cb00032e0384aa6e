"""The same plugin on NVIDIA GPUs (vLLM 0.32, FlashAttention, V1 model runner, block size 16).

Skipped without a CUDA device: nothing here has run on a GPU yet (see the issue notes). The engine
runs SmolLM2 in bfloat16 (FlashAttention refuses float32); the oracle is the Hugging Face reference
in bfloat16 on the same GPU. Two bf16 implementations round differently (8-bit mantissa: logits of
~20 move by ~0.1), so a parting counts as a tie within BF16_TIE_NATS instead of fp32's 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from engine_support import assert_same_outputs, model_path, run_engine, text_prompts
from policies import make_policy

pytestmark = [
    pytest.mark.engine,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with vllm==0.32.0"),
]
BF16_TIE_NATS = 0.15
BLOCK, BUDGET, NEW = 16, 256, 64


@pytest.mark.parametrize("policy", ["paged", "streaming", "knorm", "keydiff"])
def test_gpu_policy_equals_reference_in_bfloat16(tmp_path, policy):
    from harness.eviction.hf_reference import HFReferenceEngine

    prompts = text_prompts("smollm2", [700, 900, 1100, 1300], seed=4)
    engine = run_engine(tmp_path, "smollm2", prompts, NEW, device="cuda", dtype="bfloat16", block_size=BLOCK,
                        kv_cache_gib=None, gpu_memory_utilization=0.5, in_process=False,
                        eviction={"policy": policy, "budget": BUDGET})
    (status,) = engine["eviction_status"]
    assert status["backend"] == "FLASH_ATTN", f"the layout the harness reads, not {status['backend']}"
    assert engine["ledger"]["evictions"]["prefill"] == len(prompts) and engine["ledger"]["evictions"]["decode"] > 0
    reference = HFReferenceEngine(model_path("smollm2"), make_policy(policy, BUDGET, BLOCK),
                                dtype=torch.bfloat16, device="cuda")
    runs = [reference.generate_with_top_logprobs(prompt, NEW) for prompt in prompts]
    expected = {"outputs": [ids for ids, _ in runs], "top_logprobs": [top for _, top in runs]}
    assert_same_outputs(expected, engine, tie_nats=BF16_TIE_NATS)
    assert engine["free_blocks_after"] == engine["free_blocks_before"]

"""The same plugin on NVIDIA GPUs (vLLM 0.32, FlashAttention, V1 model runner, block size 16).

Skipped without a CUDA device: nothing here has run on a GPU yet (see the issue notes).
"""
from __future__ import annotations

import pytest
import torch

from engine_support import common_prefix, reference_outputs, run_engine, text_prompts
from policies import make_policy

pytestmark = [
    pytest.mark.engine,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with vllm==0.32.0"),
]


@pytest.mark.parametrize("policy", ["paged", "streaming", "knorm", "keydiff"])
def test_gpu_policy_equals_reference(tmp_path, policy):
    prompts = text_prompts("smollm2", [700, 900, 1100, 1300], seed=4)
    engine = run_engine(tmp_path, "smollm2", prompts, 64, device="cuda", block_size=16,
                        eviction={"policy": policy, "budget": 256})
    reference = reference_outputs("smollm2", make_policy(policy, 256, 16), prompts, 64)
    agree = [common_prefix(e, r) for e, r in zip(engine["outputs"], reference)]
    assert sum(e == r for e, r in zip(engine["outputs"], reference)) >= 3, agree
    assert engine["free_blocks_after"] == engine["free_blocks_before"]

"""The Hugging Face reference engine: faithful greedy decoding, and evictions that really shrink it."""
from __future__ import annotations

import pytest
import torch

from harness.eviction.hf_reference import DynamicCacheView, HFReferenceEngine
from policies import make_policy
from tests.support.engine_support import BLOCK, model_path, text_prompts


@pytest.fixture(scope="module")
def prompt():
    return text_prompts("tiny", [700], seed=5)[0]


def test_full_cache_reference_equals_transformers_generate(prompt):
    engine = HFReferenceEngine(model_path("tiny"))
    ours = engine.generate(prompt, 24)
    with torch.no_grad():
        generated = engine.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert ours == generated[0, len(prompt):].tolist()


# the token policies that compact per token (knorm, keydiff) take several seconds each: slow (CI runs them)
@pytest.mark.parametrize("policy", ["paged", "streaming", pytest.param("knorm", marks=pytest.mark.slow),
                                    pytest.param("keydiff", marks=pytest.mark.slow)])
def test_reference_cache_stays_within_budget(prompt, policy, monkeypatch):
    budget = 128
    engine = HFReferenceEngine(model_path("tiny"), make_policy(policy, budget, BLOCK))
    lengths = []
    original = DynamicCacheView.drop

    def recording_drop(self, dropped, remaining):
        original(self, dropped, remaining)
        lengths.append(self.cache.layers[0].keys.shape[2])

    monkeypatch.setattr(DynamicCacheView, "drop", recording_drop)
    output = engine.generate(prompt, 80)
    assert len(output) == 80
    expected_prefill = budget + len(prompt) % BLOCK if policy == "paged" else budget
    assert lengths[0] == expected_prefill, "prefill keeps exactly the policy's count"
    assert all(length == budget for length in lengths[1:]), "each decode eviction returns to the budget"
    assert len(lengths) >= 3

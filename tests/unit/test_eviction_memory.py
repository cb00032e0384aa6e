"""The memory prediction (harness.eviction.memory) against what the evictor really keeps (no engine)."""
from __future__ import annotations

import pytest
import torch

from harness.engine.backend_views import FlashAttnView
from harness.eviction.evictor import evict
from harness.eviction.memory import predict, state_per_token
from harness.eviction.state import PolicyState
from harness.config.models import ModelShape
from policies import make_policy
from tests.support.policy_matrix import MATRIX, MATRIX_IDS

LAYERS, HEADS, QUERY_HEADS, DIM, BLOCK, BUDGET = 3, 2, 4, 8, 32, 64


@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_the_state_a_request_keeps_after_prefill_and_decode_is_within_its_prediction(name, options):
    gen = torch.Generator().manual_seed(len(name))
    view = FlashAttnView([torch.randn(12, HEADS, BLOCK, 2 * DIM, generator=gen) for _ in range(LAYERS)])
    policy = make_policy(name, BUDGET, BLOCK, **options)
    state = PolicyState(scales=[0.3] * LAYERS)
    blocks = list(range(12))
    held = []
    for phase, tokens in (("prefill", 150), ("decode", BUDGET + BLOCK)):
        if policy.query_window:
            state.observe("r", torch.randn(LAYERS, BLOCK, QUERY_HEADS, DIM, generator=gen), policy.query_window)
        evict(policy, view, blocks, tokens, phase, state, "r")
        held.append(state.nbytes())
    shape = ModelShape(LAYERS, HEADS, QUERY_HEADS, DIM, 4)
    predicted = predict(policy, shape, 1, 4096, None)
    assert max(held) <= predicted.per_request
    assert predicted.per_request <= 4 * max(held) or max(held) == predicted.per_request == 0


def test_full_cache_needs_nothing_and_the_scratch_grows_with_the_context():
    shape = ModelShape(32, 8, 32, 128, 2)
    assert predict(make_policy("full", 1024, 16), shape, 256, 8192, None).total == 0
    short, long = (predict(make_policy("snapkv", 1024, 16), shape, 256, length, 256 << 20) for length in (8192, 131072))
    assert short.per_request == long.per_request and long.scratch > short.scratch


# tiny-gemma3's KV cache groups (tests/unit/test_hybrid_memory.py checks them against vLLM's): layers
# 0 and 3, 1 and 4 slide, 2 and 5 attend to everything
HYBRID_GROUPS, GLOBAL_GROUP = ((0, 3), (1, 4), (2, 5)), 2


@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_on_a_hybrid_model_the_prediction_counts_the_global_layers_scores_and_windows(name, options):
    """On a hybrid model the worker keeps a policy's scores and query window for the full-attention
    group only (the sliding-window groups run ``FullCache``: harness.engine.layer_groups.policies_by_group;
    ``QueryCapture`` copies no sliding-window layer's queries), and evicts the global layers alone:
    the prediction covers what is kept, and is below the same layers without windows wherever the
    policy keeps scores or a window per layer, or evicts."""
    gen = torch.Generator().manual_seed(len(name))
    view = FlashAttnView([torch.randn(12, HEADS, BLOCK, 2 * DIM, generator=gen) for _ in HYBRID_GROUPS[GLOBAL_GROUP]])
    policy = make_policy(name, BUDGET, BLOCK, **options)
    states = [PolicyState(scales=[0.3] * len(layers)) for layers in HYBRID_GROUPS]
    blocks, held = list(range(12)), []
    for phase, tokens in (("prefill", 150), ("decode", BUDGET + BLOCK)):
        if policy.query_window:
            queries = torch.randn(6, BLOCK, QUERY_HEADS, DIM, generator=gen)
            states[GLOBAL_GROUP].observe("r", queries[list(HYBRID_GROUPS[GLOBAL_GROUP])], policy.query_window)
        evict(policy, view, blocks, tokens, phase, states[GLOBAL_GROUP], "r")
        held.append(sum(state.nbytes() for state in states))
    hybrid = ModelShape(6, HEADS, QUERY_HEADS, DIM, 4, sliding_layers=(0, 1, 3, 4), sliding_window=32)
    predicted = predict(policy, hybrid, 1, 4096, None)
    assert max(held) <= predicted.per_request
    assert predicted.per_request <= 4 * max(held) or max(held) == predicted.per_request == 0
    whole = predict(policy, ModelShape(6, HEADS, QUERY_HEADS, DIM, 4), 1, 4096, None)
    assert predicted.per_request <= whole.per_request
    if state_per_token(policy, 2, HEADS) < state_per_token(policy, 6, HEADS) or policy.query_window:  # kept per layer
        assert predicted.per_request < whole.per_request
    if policy.evicts:
        assert predicted.scratch < whole.scratch

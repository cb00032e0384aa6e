"""A policy's failure is its own request's (no engine): a score that raises or returns the wrong
shape is refused at admission with its message; one that fails only on real input (raises, NaN)
fails its own request in ``evict_all``, and the other requests of the step are evicted exactly as
without it. The engine's side (the request ends with an error, the server goes on) is
``tests/engine/test_serve.py``."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from harness.eviction.evictor import Due, PolicyFailure, evict_all, not_finite
from harness.eviction.settings import parse_settings, request_settings
from harness.eviction.state import PolicyState
from harness.engine.backend_views import FlashAttnView
from policies import REGISTRY, make_policy

LAYERS, HEADS, DIM, B, POOL = 2, 2, 8, 32, 40
MODULE = "tests.support.faulty_scores"


@pytest.fixture
def faulty():
    """The faulty scores registered for one test, then gone (other tests walk the registry)."""
    module = importlib.import_module(MODULE)
    names = [name for name in REGISTRY if name.startswith("faulty_")]
    yield module
    for name in names:
        REGISTRY.pop(name)
    sys.modules.pop(MODULE)


@pytest.mark.parametrize("name, message", [
    ("faulty_raises", "policy faulty_raises failed: RuntimeError: this score is broken"),
    ("faulty_shape", "policy faulty_shape failed: its score returned (64,); a score returns [kv_heads, tokens] = [2, 64]"),
])
def test_a_score_that_fails_on_any_input_is_refused_at_admission(faulty, name, message):
    with pytest.raises(ValueError, match="request kv_eviction: ") as refused:
        request_settings({"kv_eviction": {"policy": name, "budget": 128}}, None, B)
    assert message in str(refused.value)


def test_a_score_that_fails_on_real_input_passes_admission(faulty):
    for name in ("faulty_late", "faulty_nan"):
        assert request_settings({"kv_eviction": {"policy": name, "budget": 128}}, None, B) == \
            parse_settings({"policy": name, "budget": 128}, "x")


@pytest.mark.parametrize("name, message", [
    ("faulty_late", "policy faulty_late failed: ZeroDivisionError: a bug that only long prompts reach"),
    ("faulty_nan", "policy faulty_nan failed: its score returned NaN or infinite values, first in layer 0"),
])
def test_a_policy_failing_in_a_step_fails_its_own_request_only(faulty, name, message):
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(POOL, HEADS, B, 2 * DIM, generator=gen) for _ in range(LAYERS)]
    blocks = torch.randperm(POOL, generator=gen).tolist()
    good = [("a", "paged", blocks[0:8], 230), ("c", "knorm", blocks[16:24], 200)]
    bad = ("b", name, blocks[8:16], 240)

    def run(cases, failures):
        view = FlashAttnView([c.clone() for c in caches])
        dues = [Due(rid, make_policy(policy, 128, B), list(ids), tokens, "prefill") for rid, policy, ids, tokens in cases]
        return view, evict_all(view, dues, PolicyState(), failures=failures)

    failures = {}
    with_bad, evictions = run([good[0], bad, good[1]], failures)
    without_bad, alone = run(good, {})
    assert list(failures) == ["b"] and str(failures["b"]) == message
    assert evictions == alone, "the others evict as if the failing request had not been due"
    assert all(torch.equal(x, y) for x, y in zip(with_bad.layers, without_bad.layers)), "nothing of it was written"
    with pytest.raises(PolicyFailure, match=message):
        run([bad], None)  # without a failures dict (the Hugging Face reference) it raises


def test_a_non_finite_score_is_found_once_per_step_and_named_by_its_first_layer():
    """``score_together`` checks finiteness once after the last layer (no device read per layer):
    the failure still names the first layer with a NaN or an infinity."""
    policy = make_policy("knorm", 128, B)
    scores = torch.zeros(3, HEADS, 16)
    assert not_finite(policy, scores, [0, 2, 5]) is None
    scores[2, 1, 3], scores[1, 0, 0] = float("nan"), float("inf")
    assert str(not_finite(policy, scores, [0, 2, 5])) == \
        "policy knorm failed: its score returned NaN or infinite values, first in layer 2"

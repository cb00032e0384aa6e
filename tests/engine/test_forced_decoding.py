"""Teacher forcing in the engine (``harness.engine.forced_decoding``) against the Hugging Face
reference: the log-likelihood of a given continuation, eviction applied exactly as in generation."""
from __future__ import annotations

import pytest

from policies import make_policy
from tests.support.engine_support import BLOCK, mixed_lengths, model_path, run_engine, text_prompts

pytestmark = pytest.mark.engine

BUDGET = 128
FORCED = 48  # with prompts over the budget: prefill eviction, then a decode eviction at budget + block
# Per prompt, that request's policy: one engine serves them all (per-request settings).
POLICIES = ["full", "paged", "snapkv", "knorm"] * 2
TOLERANCE = 2e-3  # nats: two fp32 implementations' rounding, far below any eviction effect


@pytest.fixture(scope="module")
def forced_run(tmp_path_factory):
    prompts = text_prompts("tiny", mixed_lengths(len(POLICIES), 300, 900, seed=7), seed=7)
    continuations = [ids[:FORCED] for ids in text_prompts("tiny", [FORCED + 8] * len(POLICIES), seed=8)]
    requests = [{"policy": "full"} if p == "full" else {"policy": p, "budget": BUDGET} for p in POLICIES]
    run = run_engine(tmp_path_factory.mktemp("forced"), "tiny", prompts, FORCED, forced=continuations,
                     request_eviction=requests, eviction={"policy": "paged", "budget": BUDGET})
    return prompts, continuations, run


def test_forced_tokens_are_emitted_with_the_models_own_logprobs(forced_run):
    prompts, continuations, run = forced_run
    assert run["outputs"] == continuations, "the engine emitted exactly the forced tokens"
    assert all(len(lp) == FORCED and all(v <= 0 for v in lp) for lp in run["token_logprobs"])
    # Real text the model did not write: it is not the model's first choice everywhere.
    assert any(rank > 1 for ranks in run["token_ranks"] for rank in ranks)
    assert run["ledger"]["evictions"]["decode"] > 0, "decode evictions happened while forcing"
    assert run["free_blocks_after"] == run["free_blocks_before"], "every block came back"


def test_forced_log_likelihood_equals_the_hugging_face_reference(forced_run):
    from harness.eviction.hf_reference import HFReferenceEngine

    prompts, continuations, run = forced_run
    for name in dict.fromkeys(POLICIES):
        reference = HFReferenceEngine(model_path("tiny"), None if name == "full" else make_policy(name, BUDGET, BLOCK))
        for index in (i for i, p in enumerate(POLICIES) if p == name):
            expected = reference.forced_logprobs(prompts[index], continuations[index])
            got = run["token_logprobs"][index]
            worst = max(abs(a - b) for a, b in zip(expected, got))
            assert worst < TOLERANCE, f"{name} request {index}: forced log-probabilities differ by up to {worst:.2e}"


def test_forcing_the_greedy_output_reports_rank_one(tmp_path):
    """Forcing what the model would generate anyway changes nothing: every emitted token has rank 1
    and its log-probability is the greedy run's best."""
    prompts = text_prompts("tiny", [400, 700], seed=9)
    greedy = run_engine(tmp_path, "tiny", prompts, 24, top_logprobs=1, eviction={"policy": "paged", "budget": BUDGET})
    forced = run_engine(tmp_path, "tiny", prompts, 24, forced=greedy["outputs"], eviction={"policy": "paged", "budget": BUDGET})
    assert forced["outputs"] == greedy["outputs"]
    assert all(rank == 1 for ranks in forced["token_ranks"] for rank in ranks)
    for best, got in zip(greedy["top_logprobs"], forced["token_logprobs"]):
        assert max(abs(b[0][1] - g) for b, g in zip(best, got)) < 1e-5

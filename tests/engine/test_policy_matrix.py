"""Every registered policy at every granularity (``tests/support/policy_matrix.py``, derived from the
registry) in the real engine: one SmolLM2 engine runs them all in one batch through per-request
settings, and each equals the plain reference that shares no code with policies/ or
harness/engine/. The plain reference equals the harness's Hugging Face reference for the same
matrix (``tests/unit/test_plain_reference.py``, on the tiny model), so the engine equals both. A newly
registered score is checked here with no test edited. The attention-free ones also run in vLLM's
compiled mode (``enforce_eager=false``) and equal their eager outputs: on the tiny Llama, in
tests/engine/test_engine_tensor_parallel.py (whose one-worker engine runs the matrix eagerly;
compiling SmolLM2's 30 layers took a minute more than the tiny model's 4)."""
from __future__ import annotations

import pytest

from policies import REGISTRY
from tests.support.engine_support import (
    BLOCK, DECODE_EVICTING_TOKENS, assert_mostly_equal, model_path, plain_policy, run_engine, text_prompts,
)
from tests.support.policy_matrix import MATRIX, MATRIX_IDS

pytestmark = pytest.mark.engine

# Every case evicts in decode too (asserted per case against the plain reference's counts).
BUDGET, NEW_TOKENS = 256, DECODE_EVICTING_TOKENS


# One prompt of 300 tokens (9 blocks and 12 tokens of a 10th; 528 before, CI time: the plain reference
# prefills it once per case, the costly part of this file): 44 tokens past the budget, so every case
# evicts in prefill, and 40 new tokens take each past budget + one block after that, so it evicts in
# decode again (both asserted per case against the plain reference's counts, and the engine's
# prefill evictions in the ledger).
PROMPT_TOKENS = 300


@pytest.fixture(scope="module")
def prompts():
    """One prompt of PROMPT_TOKENS: it evicts in prefill, and 40 new tokens evict in decode again.
    One, not two (CI time): the plain reference generates it once per case; test_engine and
    test_context_compression run several prompts per policy."""
    prompts = text_prompts("smollm2", [PROMPT_TOKENS], seed=2)
    assert len(prompts[0]) > BUDGET and len(prompts[0]) % BLOCK, "past the budget, a partial last block"
    return prompts


@pytest.fixture(scope="module")
def matrix_run(tmp_path_factory, prompts):
    settings = [{"policy": name, "budget": BUDGET, "options": options} for name, options in MATRIX for _ in prompts]
    return run_engine(tmp_path_factory.mktemp("matrix"), "smollm2", prompts * len(MATRIX), NEW_TOKENS,
                      request_eviction=settings)


def outputs_of(run, case: int, count: int) -> list:
    return run["outputs"][case * count : (case + 1) * count]


@pytest.fixture(scope="module")
def plain_runs(prompts):
    from tests.support.plain_reference import PlainReference

    plain = PlainReference(model_path("smollm2"))
    return [[plain.generate(prompt, NEW_TOKENS, plain_policy(name, BUDGET, BLOCK, options.get("granularity")))
             for prompt in prompts] for name, options in MATRIX]


@pytest.mark.parametrize("case", range(len(MATRIX)), ids=MATRIX_IDS)
def test_engine_equals_the_plain_reference(matrix_run, plain_runs, prompts, case):
    assert_mostly_equal(outputs_of(matrix_run, case, len(prompts)), [ids for ids, _ in plain_runs[case]])
    assert all(counts["prefill"] == 1 and counts["decode"] >= 1 for _, counts in plain_runs[case])


def test_engine_evicts_in_both_phases_returns_every_block_and_measures_the_capture(matrix_run, plain_runs, prompts):
    ledger = matrix_run["ledger"]
    assert ledger["evictions"]["prefill"] == len(MATRIX) * len(prompts)
    assert ledger["evictions"]["decode"] == sum(c["decode"] for runs in plain_runs for _, c in runs)
    assert matrix_run["free_blocks_after"] == matrix_run["free_blocks_before"] == ledger["kv_pool_blocks"]
    reading = [name for name, _ in MATRIX if REGISTRY[name].reads_attention]
    assert reading and 0 < ledger["capture_s"] < ledger["model_s"]
    # Windows of at most 32 queries x 30 layers x 9 heads x 64 dims in float32 (2.2 MB) per live
    # request, and per-(layer, head, token) totals or scores.
    requests = len(MATRIX) * len(prompts)
    assert 0 < ledger["policy_state_bytes_peak"] <= requests * (32 * 30 * 9 * 64 * 4 + 30 * 3 * 2048 * 4)


def test_the_policy_state_the_worker_held_stays_within_its_prediction(matrix_run, prompts):
    """The most per-request policy state the worker held at once (the ledger's peak) is at most the
    sum of each request's predicted state (``harness.eviction.memory``), and the prediction is not
    vacuous: within 4x of what was held."""
    from harness.eviction.memory import predict
    from harness.config.models import model_shape
    from policies import make_policy

    shape = model_shape(model_path("smollm2"), "float32")
    predicted = sum(predict(make_policy(name, BUDGET, BLOCK, **options), shape, 1, 4096, None).per_request
                    for name, options in MATRIX for _ in prompts)
    held = matrix_run["ledger"]["policy_state_bytes_peak"]
    assert 0 < held <= predicted < 4 * held


def test_a_protected_prefix_in_the_engine_equals_the_plain_reference(tmp_path):
    """``protect_prefix`` (a request's own setting) in the engine: PagedEviction (blocks) and StreamingLLM
    (tokens) with the prompt's first 100 tokens protected equal the plain reference token for token,
    which keeps the tokens at logical positions below 100 by its own rule (its cache still holds them
    after both phases' evictions); the same requests unprotected, in the same batch (the file's
    engine), answer otherwise: the setting reached the engine and changed what it kept. Its own
    prompt of 528 tokens (the matrix's before that was cut to 300): 256 or more evicted in prefill,
    so that the unprotected rules evict within the first 100 tokens, where a 44-token cut might not."""
    import torch

    from tests.support.plain_reference import PlainReference

    cases, prefix = ("paged", "streaming"), 100
    prompts = text_prompts("smollm2", [528], seed=2)
    settings = [{"policy": name, "budget": BUDGET, "protect_prefix": protected}
                for protected in (prefix, 0) for name in cases]
    run = run_engine(tmp_path, "smollm2", prompts[:1] * len(settings), NEW_TOKENS, request_eviction=settings)
    plain = PlainReference(model_path("smollm2"))
    for index, name in enumerate(cases):
        rule = plain_policy(name, BUDGET, BLOCK)
        rule.protect_prefix = prefix
        ids, counts = plain.generate(prompts[0], NEW_TOKENS, rule)
        assert counts["prefill"] == 1 and counts["decode"] >= 1, "both phases evict"
        assert all((held[:, :prefix] == torch.arange(prefix)).all() for held in plain.positions), "the prefix stayed"
        assert run["outputs"][index] == ids, name
        assert run["outputs"][len(cases) + index] != ids, f"{name}: unprotected, the engine answers otherwise"
    assert run["ledger"]["evictions"]["prefill"] == len(settings)
    assert run["free_blocks_after"] == run["free_blocks_before"] == run["ledger"]["kv_pool_blocks"]

"""Per-request eviction settings and eviction under prefix caching, in the real engine.

With prefix caching on, every policy's outputs must equal its outputs with prefix caching off
(near-tie rule), with mixed policies and budgets in one batch, requests sharing a prompt, and
preemption; no block the prefix cache holds is ever written; the pool's free count returns to
its start. Each engine runs in a process of its own (harness.engine.batch_run's batches, on the engine
tests' kept engines: tests/support/engine_pool.py, each batch on an emptied prefix cache).
"""
from __future__ import annotations

import pytest

from tests.support.engine_support import assert_same_outputs, mixed_lengths, run_engine, text_prompts

pytestmark = pytest.mark.engine

# Eight requests, four prompts each asked twice, every policy at two budgets plus full cache:
# prefill evictions (prompts 350-900 tokens over budgets of 128-256) and decode evictions
# (80 new tokens cross budget + block again).
MIXED = [
    {"policy": "paged", "budget": 128}, {"policy": "knorm", "budget": 256}, {"policy": "streaming", "budget": 128},
    {"policy": "full"}, {"policy": "keydiff", "budget": 192}, {"policy": "snapkv", "budget": 256},
    {"policy": "h2o", "budget": 128}, {"policy": "paged_token", "budget": 128},
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix_caching")


@pytest.fixture(scope="module")
def shared_prompts():
    prompts = text_prompts("smollm2", mixed_lengths(4, 350, 900, seed=3), seed=5)
    return prompts + prompts


@pytest.fixture(scope="module")
def without_cache(workdir, shared_prompts):
    return run_engine(workdir, "smollm2", shared_prompts, 80, request_eviction=MIXED)


# Before the batches of one request (CI time): its engine, SmolLM2 with prefix caching, is the one
# tests/engine/test_context_compression.py used last, still running (tests/engine/conftest.py).
def test_prefix_caching_changes_no_output_and_writes_no_cached_block(workdir, shared_prompts, without_cache):
    with_cache = run_engine(workdir, "smollm2", shared_prompts, 80, request_eviction=MIXED,
                            prefix_caching=True, warm_cache=True)
    assert_same_outputs(without_cache, with_cache)
    assert with_cache["ledger"]["evictions"] == without_cache["ledger"]["evictions"]
    assert with_cache["ledger"]["evictions"]["decode"] > 0 and with_cache["ledger"]["evictions"]["prefill"] > 0
    # Compaction wrote into blocks of the request's own instead of the cached prompt ...
    assert with_cache["ledger"]["copy_target_blocks"] > 0
    # ... so every block the warm-up registered still holds what its hash describes.
    cached = with_cache["cached_blocks"]
    assert cached["registered_before"] >= 4 and cached["still_registered"] == cached["registered_before"]
    assert cached["changed"] == 0
    assert with_cache["free_blocks_after"] == with_cache["free_blocks_before"]


def test_mixed_policies_in_one_batch_equal_each_policy_alone(workdir, shared_prompts, without_cache):
    """Per-request settings: a batch mixing five policies and full cache gives each request what
    an engine running only that request's settings gives it."""
    for index in (3, 0, 1):  # full cache first: it runs on the engine of the mixed batch (no default policy)
        settings = MIXED[index]
        alone = run_engine(workdir, "smollm2", [shared_prompts[index]], 80,
                           eviction=settings if settings["policy"] != "full" else None)
        assert_same_outputs({"outputs": [without_cache["outputs"][index]],
                             "top_logprobs": [without_cache["top_logprobs"][index]]}, alone)


def preempted_requests(policy: str) -> tuple[list[list[int]], list[dict]]:
    """Eight requests on four short prompts (each asked twice), six at budget 384 and two at 256."""
    prompts = text_prompts("tiny", [100, 130, 100, 130], seed=3)
    return prompts + prompts, [{"policy": policy, "budget": 384}] * 6 + [{"policy": policy, "budget": 256}] * 2


def uncopyable_requests() -> tuple[list[list[int]], list[dict]]:
    """Two 600-token prompts at budget 512 (and two of 100 tokens that never evict)."""
    return text_prompts("tiny", [100, 600, 100, 600], seed=3), [{"policy": "paged", "budget": 512}] * 4


@pytest.fixture(scope="module")
def roomy(workdir):
    """What the tight pools below must reproduce: every one of their requests, each with its own
    settings, in one batch on one engine without prefix caching whose pool (cpu.yaml's) never
    preempts. Per test (the preemption test's two policies, the uncopyable requests): its requests'
    outputs and top log-probabilities."""
    parts = {"paged": preempted_requests("paged"), "knorm": preempted_requests("knorm"),
             "uncopyable": uncopyable_requests()}
    prompts = [prompt for part_prompts, _ in parts.values() for prompt in part_prompts]
    settings = [each for _, part_settings in parts.values() for each in part_settings]
    run = run_engine(workdir, "tiny", prompts, 300, request_eviction=settings)
    assert sum(run["preemptions"]) == 0
    assert run["ledger"]["preempted_after_eviction"] == 0
    slices, at = {}, 0
    for name, (part_prompts, _) in parts.items():
        slices[name] = {key: run[key][at:at + len(part_prompts)] for key in ("outputs", "top_logprobs")}
        at += len(part_prompts)
    return slices


def test_requests_whose_copies_cannot_fit_stay_out_of_the_prefix_cache(workdir, roomy):
    """A 600-token prompt at budget 512 needs 19 + 17 blocks to compact into copies, more than a
    30-block pool: such requests neither take nor leave cached blocks and compact in place."""
    prompts, settings = uncopyable_requests()
    tight = run_engine(workdir, "tiny", prompts, 300, eviction=settings[0], prefix_caching=True, num_kv_blocks=30,
                       max_model_len=900)
    assert sum(tight["preemptions"]) > 0
    assert_same_outputs(roomy["uncopyable"], tight)
    assert tight["free_blocks_after"] == tight["free_blocks_before"]


def test_a_bad_request_is_refused_with_the_reason(workdir):
    """Offline, vLLM's validation refuses the whole call (``vllm serve`` refuses just that request:
    test_serve)."""
    prompts = text_prompts("tiny", [300, 300], seed=1)
    with pytest.raises(RuntimeError, match="not a multiple of block_size=32"):
        run_engine(workdir, "tiny", prompts, 8, request_eviction=[{"policy": "paged", "budget": 100}, None])


@pytest.mark.parametrize("policy", ["paged", "knorm"])
def test_prefix_caching_under_preemption(workdir, roomy, policy):
    """Eight requests on four short prompts (each asked twice) growing to 13 blocks in a 30-block
    pool: the scheduler preempts requests that had evicted; they replay from the cached prompt
    (hits stop at the prompt's end) and meet the same evictions again."""
    prompts, settings = preempted_requests(policy)
    tight = run_engine(workdir, "tiny", prompts, 300, request_eviction=settings, prefix_caching=True,
                       num_kv_blocks=30, max_model_len=900)
    assert sum(tight["preemptions"]) > 0 and tight["ledger"]["preempted_after_eviction"] > 0
    assert_same_outputs(roomy[policy], tight)
    assert tight["free_blocks_after"] == tight["free_blocks_before"]

"""The real Gemma 3 270M in the engine (issue 66): full cache equals stock vLLM on held-out prompts,
and eviction of its three global layers equals the plain reference, with blocks freed only in the
global KV cache group while vLLM's sliding-window manager frees the five local groups' blocks.

``tests/engine/test_hybrid_engine.py`` checks the same on the tiny hybrid model, in CI. This file
needs the converted checkpoint (``./setup.sh gemma3-270m``, a minute or two): where it is not
prepared (CI's clean clone) the whole file skips before anything loads, so it adds no CI time. Where
it is, it starts four engines of Gemma (stock, plugin, evicting, KVzip), each in its own process."""
from __future__ import annotations

import pytest

from harness.config.models import GEMMA3, cache_dir, is_complete

CHECKPOINT = cache_dir() / "models" / GEMMA3
if not is_complete(CHECKPOINT):
    # resolve_model_path would convert it here (minutes): a test never prepares Gemma by itself
    pytest.skip(f"{GEMMA3} is not prepared here (./setup.sh {GEMMA3})", allow_module_level=True)

from harness.engine.batch_run import run_in_subprocess  # noqa: E402
from tests.support.engine_support import (BLOCK, DECODE_EVICTING_TOKENS,  # noqa: E402
                                          assert_policy_equals_plain_reference, assert_same_outputs,
                                          mixed_lengths, stock_and_policy_runs)

pytestmark = pytest.mark.engine

WINDOW = 512  # the local layers' sliding window (config.json's sliding_window)
# block rules on K/V scores (paged, knorm), a positional rule, and one reading the global layers'
# queries (query capture beside sliding-window layers); KVzip, whose passes run through the local
# layers too, in a run of its own below
POLICIES = ["paged", "streaming", "knorm", "snapkv"]
BUDGET = 256
# Held-out prompts (a seed no other test uses) of 600-2000 tokens: past the window, so the local
# groups slide, and past the budget, so the global group evicts in prefill and in decode
# (DECODE_EVICTING_TOKENS).
LENGTHS = mixed_lengths(6, 600, 2000, seed=66)
NEW_TOKENS = DECODE_EVICTING_TOKENS


@pytest.fixture(scope="module")
def prompts():
    """Text cut from the suite's documents, each after Gemma's ``<bos>`` (the model degrades without it,
    and greedy output of a degraded model is full of near-ties)."""
    from transformers import AutoTokenizer

    from harness.tasks.embedded.token_prompts import token_prompts

    bos = AutoTokenizer.from_pretrained(CHECKPOINT).bos_token_id
    return [[bos, *ids[:-1]] for ids in token_prompts(str(CHECKPOINT), LENGTHS, 66)]


@pytest.fixture(scope="module")
def run(prompts, tmp_path_factory):
    """The stock, unreached and evicting runs (``stock_and_policy_runs``), each engine in a process
    of its own."""
    return stock_and_policy_runs(str(CHECKPOINT), prompts, POLICIES, BUDGET, NEW_TOKENS, tmp_path_factory,
                                 runner=run_in_subprocess)


def test_full_cache_equals_stock_vllm_on_gemma3(run):
    stock, unreached = run("stock"), run("unreached")
    assert stock["ledger"] is None and unreached["ledger"]["policy"] == "paged", "plugin off / on as asked"
    # vLLM's own grouping: five sliding-window groups of three layers and the global one (5, 11, 17)
    assert unreached["ledger"]["kv_cache_groups"] == 6
    assert unreached["ledger"]["freed_blocks"] == 0
    assert_same_outputs(stock, unreached)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_of_gemma3_s_global_layers_equals_the_plain_reference(run, prompts, policy):
    assert_policy_equals_plain_reference(run, str(CHECKPOINT), prompts, POLICIES, policy, BUDGET, NEW_TOKENS)


def test_gemma3_frees_blocks_in_the_global_group_only_and_vllm_frees_the_windows(run):
    ledger = run("evicting")["ledger"]
    peaks = sorted(ledger["evicting_group_blocks_peak"])
    # the global group: the budget and the block decode fills past it; each local group: the window
    # and the newest block (vllm/v1/kv_cache_interface.py:859-885), more than the budget's blocks
    assert peaks == [BUDGET // BLOCK + 1] + [-(-(WINDOW - 1) // BLOCK) + 1] * 5
    assert ledger["freed_blocks"] > 0
    assert run("evicting")["free_blocks_after"] == ledger["kv_pool_blocks"]  # every block came back


KVZIP_PROMPTS = 3  # the first three held-out prompts, each compressed whole by KVzip (one pass each)


def test_kvzip_on_gemma3_equals_the_plain_reference(prompts, tmp_path_factory):
    """KVzip compressing each whole prompt to BUDGET (its reconstruction ids as ``vllm serve`` makes
    them for a plain prompt, ``ids_reconstruction``): the pass runs through all 18 layers, each local
    one over its window of 512, and the three global layers evict once, in prefill; the outputs equal
    the plain reference's (near-tie rule) and differ from full cache's; every block returns."""
    from dataclasses import asdict

    from transformers import AutoTokenizer

    from harness.config import engine_settings
    from harness.tasks.prompts import ids_reconstruction
    from tests.support.engine_support import assert_mostly_equal, plain_policy
    from tests.support.plain_reference import PlainReference, Repeat

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    chosen = prompts[:KVZIP_PROMPTS]
    settings = []
    for prompt in chosen:
        spec = ids_reconstruction(tokenizer, prompt)
        assert spec is not None and spec["prefix_tokens"] == 0  # a plain prompt: no header
        settings.append({"policy": "kvzip", "budget": BUDGET, "decode_eviction": False, "reconstruction": spec})
    spec = {"model_path": str(CHECKPOINT), "prompts": chosen, "max_new_tokens": NEW_TOKENS, "max_model_len": 4096,
            "top_logprobs": 3, "eviction": {"policy": "paged", "budget": 2048}, "request_eviction": settings,
            "engine": asdict(engine_settings())}
    run = run_in_subprocess(spec, tmp_path_factory.mktemp("kvzip"), timeout_s=900)
    assert all(c["evictions"] == {"prefill": 1, "decode": 0} for c in run["request_counters"])
    assert run["ledger"]["reconstruct_tokens"] > sum(len(p) for p in chosen)  # one pass each: the prompt again
    assert run["free_blocks_after"] == run["free_blocks_before"] == run["ledger"]["kv_pool_blocks"]
    plain = PlainReference(str(CHECKPOINT))
    expected, whole = [], []
    for prompt, raw in zip(chosen, settings):
        rule = plain_policy("kvzip", BUDGET)
        rule.decode_eviction = False
        r = raw["reconstruction"]
        rule.repeat = Repeat(r["prefix_tokens"], r["first"], r["later"], r["suffix"])
        ids, counts = plain.generate(prompt, NEW_TOKENS, rule)
        assert counts["prefill"] == 1 and counts["decode"] == 0
        expected.append(ids)
    assert_mostly_equal(run["outputs"], expected)
    for prompt in chosen:  # full cache: a budget no prompt reaches
        whole.append(plain.generate(prompt, NEW_TOKENS, plain_policy("knorm", 4096))[0])
    assert whole != expected

"""KVzip's own allocation over layer groups in the real engine (issue 50): ``budget_schedule=kvzip``.

KVzip's default keeps the top-scoring (layer, head, token) entries of the whole cache, one threshold
across layers and heads. On an engine of G layer groups (``engine.layer_groups``) each group gets its
layers' entries above that threshold as its budget (whole blocks, summing to G x the budget; the
heads of a layer stay equal, as a paged slot holds every head's token), measured by the worker from
the reconstruction scores in the step that reaches the context's end, before that step's eviction
(``worker_patch.reconstruct_due``), and reported to the scheduler as the attention schedule's are.

SmolLM2's 30 layers as two groups of 15, a budget of 320 tokens (10 blocks a layer and head, 20 in
all), 256-token chunks; two contexts (620 and 500 tokens, 12 of header), three requests (the first
context asked two questions). Shown: each request's measured budgets equal the Hugging Face
reference's (the same measurement on its own run of the passes) and lie within a block of the
global threshold's exact shares computed here, by sorting, from the plain reference's own scores
(no harness code); the groups' budgets differ (not the uniform schedule); the same context gives the same budgets whatever
the question (KVzip is query-agnostic); the engine generates what the Hugging Face reference
generates (near-tie rule) and what the plain reference generates evicting each group by those
budgets; each group keeps exactly its budget (whole blocks). One engine, with prefix caching on, the
context prefilled in 256-token chunks and the passes run in pieces of 256 (what the pieces change
is proven against one piece by tests/engine/test_kvzip.py; one engine start fewer, for CI time):
it shares no compressed context (a measured schedule's request takes none and leaves none)."""
from __future__ import annotations

import math

import pytest

from harness.eviction.settings import Reconstruction, group_policies, parse_settings
from policies.kvzip import passes
from tests.support.engine_support import (BLOCK, assert_mostly_equal, assert_same_outputs, kvzip_reconstruction,
                                          model_path, plain_policy, run_engine, scored_contexts, text_prompts)

pytestmark = pytest.mark.engine

NEW_TOKENS = 24
BUDGET = 320
GROUPS = 2
LAYERS = 30
PREFIX = 12
CHUNK = 256


@pytest.fixture(scope="module")
def reconstruction():
    return kvzip_reconstruction("smollm2", PREFIX)


def schedule(reconstruction: dict | None = None, context_tokens: int | None = None) -> dict:
    raw = {"policy": "kvzip", "options": {"chunk_size": CHUNK}, "budget": BUDGET, "decode_eviction": False,
           "compress": "context", "budget_schedule": "kvzip"}
    if reconstruction is not None:
        raw.update(reconstruction=reconstruction, context_tokens=context_tokens)
    return raw


@pytest.fixture(scope="module")
def requests(reconstruction):
    """(context length, prompt, settings) of each request: the first context with two questions, the
    second with the first question."""
    first = text_prompts("smollm2", [620], seed=8)[0]
    second = text_prompts("smollm2", [500], seed=11)[0]
    questions = text_prompts("smollm2", [40, 65], seed=9)
    return [(len(context), context + question, schedule(reconstruction, len(context)))
            for context, question in ((first, questions[0]), (first, questions[1]), (second, questions[0]))]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, requests):
    prompts, settings = [p for _, p, _ in requests], [s for _, _, s in requests]
    return run_engine(tmp_path_factory.mktemp("kvzip_schedule"), "smollm2", prompts, NEW_TOKENS,
                      request_eviction=settings, layer_groups=GROUPS, prefix_caching=True, max_num_batched_tokens=256)


def engine_budgets(run: dict) -> list[tuple[int, ...]]:
    return [tuple(counters["group_budgets"]) for counters in run["request_counters"]]


@pytest.fixture(scope="module")
def hf_reference(requests):
    """The Hugging Face reference measuring alike: its outputs, top log-probabilities and budgets."""
    from harness.eviction.hf_reference import HFReferenceEngine

    parsed = parse_settings(schedule(), "test")
    reference = HFReferenceEngine(model_path("smollm2"), list(group_policies(parsed, BLOCK, LAYERS, GROUPS)),
                                  schedule=parsed)
    outputs, best, budgets = [], [], []
    for context, prompt, raw in requests:
        ids, top = reference.generate_with_top_logprobs(prompt, NEW_TOKENS, context_tokens=context,
                                                        reconstruction=Reconstruction.parse(raw["reconstruction"], "t"))
        outputs.append(ids), best.append(top), budgets.append(reference.measured_budgets)
    return {"outputs": outputs, "top_logprobs": best, "budgets": budgets}


@pytest.fixture(scope="module")
def plain_runs(engine_run, requests):
    """The plain reference evicting each group by the engine's measured budgets; the scores its own
    passes computed (every layer's, before the eviction) and each request's counts."""
    from tests.support.plain_reference import PlainReference, Repeat

    plain = PlainReference(model_path("smollm2"))
    scores = []
    reconstruct = plain._reconstruct

    def keeping(cache, context, policies):
        scores.append(reconstruct(cache, context, policies).clone())
        return scores[-1]

    plain._reconstruct = keeping
    outputs, counts = [], []
    for (context, prompt, raw), budgets in zip(requests, engine_budgets(engine_run)):
        spec = raw["reconstruction"]
        rules = []
        for budget in budgets:
            rule = plain_policy("kvzip", budget, BLOCK)
            rule.decode_eviction = False
            rule.repeat = Repeat(spec["prefix_tokens"], spec["first"], spec["later"], spec["suffix"], CHUNK)
            rules.append(rule)
        ids, count = plain.generate(prompt, NEW_TOKENS, rules, context_tokens=context)
        outputs.append(ids), counts.append(count)
    assert len(scores) == len(requests)
    return {"outputs": outputs, "counts": counts, "scores": scores}


def threshold_targets(scores, context: int) -> list[float]:
    """Each group's exact share, in blocks, under one threshold over every layer's and head's
    ``[layers, heads, context]`` scores: the ``layers x heads x BUDGET`` best, each group its layers'
    count (a tie at the threshold split in proportion), scaled to the groups' ``G x BUDGET`` tokens;
    then a group below its floor of two blocks is raised to it, one above its cap (the context's
    blocks) lowered, and the other takes the rest (two groups)."""
    layers, heads, tokens = scores.shape
    kept = layers * heads * min(BUDGET, tokens)
    threshold = scores.flatten().sort(descending=True).values[kept - 1]
    above = (scores > threshold).sum(dim=(1, 2)).double()
    tied = (scores == threshold).sum(dim=(1, 2)).double()
    per_layer = above + (kept - above.sum()) * tied / tied.sum()
    shares = per_layer.reshape(GROUPS, -1).sum(dim=1)
    total = GROUPS * BUDGET // BLOCK
    targets = (shares / kept * total).tolist()
    floor, cap = 2, math.ceil(context / BLOCK)
    for group, target in enumerate(targets):
        bound = floor if target < floor else cap if target > cap else None
        if bound is not None:
            targets = [bound if g == group else total - bound for g in range(GROUPS)]
    return targets


def pass_tokens(context: int, prompt: list[int], raw: dict) -> int:
    spec = raw["reconstruction"]
    return sum(len(ids) for ids, _, _ in passes(prompt[:context], spec["prefix_tokens"], spec["first"], spec["later"],
                                                spec["suffix"], CHUNK, 8))


def test_each_request_measures_the_global_thresholds_budgets(engine_run, requests, hf_reference, plain_runs):
    """Each request's group budgets (its record's ``group_budgets``): whole blocks summing to the
    uniform total, equal to the Hugging Face reference's, within a block of the exact shares the
    plain reference's own scores give, larger where that share is; the groups' budgets differ; the
    same context gives the same budgets whatever the question."""
    run = engine_budgets(engine_run)
    for index, ((context, _, _), budgets) in enumerate(zip(requests, run)):
        assert len(budgets) == GROUPS and all(b % BLOCK == 0 for b in budgets), budgets
        assert sum(budgets) == GROUPS * BUDGET, budgets
        assert budgets == tuple(hf_reference["budgets"][index]), (budgets, hf_reference["budgets"][index])
        targets = threshold_targets(plain_runs["scores"][index], context)
        assert all(abs(b // BLOCK - t) < 1 for b, t in zip(budgets, targets)), (budgets, targets)
        if budgets[0] != budgets[1]:  # the group the threshold favours gets more
            assert (budgets[0] > budgets[1]) == (targets[0] > targets[1]), (budgets, targets)
    assert any(budgets[0] != budgets[1] for budgets in run), run  # not the uniform schedule
    assert run[0] == run[1]  # one context, two questions: the same scores, the same budgets


def test_the_engine_equals_the_hugging_face_reference(engine_run, hf_reference):
    assert_same_outputs({key: hf_reference[key] for key in ("outputs", "top_logprobs")}, engine_run)


def test_the_engine_equals_the_plain_reference_keeping_each_groups_budget(engine_run, requests, plain_runs):
    """The plain reference evicting each group's layers by the engine's measured budget generates
    what the engine generates (near-tie rule as the other reference comparisons); each group keeps
    exactly its budget of the context (whole blocks), in the engine's counts and in the plain
    reference's layer lengths; the passes' tokens are the ledger's; every block returns."""
    run = engine_run
    assert_mostly_equal(run["outputs"], plain_runs["outputs"])
    for (context, prompt, _), budgets, counters, counts in zip(requests, engine_budgets(run), run["request_counters"],
                                                                plain_runs["counts"]):
        assert counters["evicted_tokens"] == sum(max(0, context - b) for b in budgets), (counters, budgets)
        question = len(prompt) - context
        span = LAYERS // GROUPS
        assert counts["lengths"] == [min(b, context) + question + NEW_TOKENS - 1 for b in budgets for _ in range(span)]
    ledger = run["ledger"]
    assert ledger["evictions"]["decode"] == 0
    scored = scored_contexts([(p, raw) for _, p, raw in requests])  # the first context's second question reuses
    assert ledger["reconstruct_tokens"] == sum(pass_tokens(*requests[i]) for i in scored)
    assert ledger["reconstruct_reused"] == len(requests) - len(scored) == 1
    assert run["free_blocks_after"] == run["free_blocks_before"] == ledger["kv_pool_blocks"]


def test_with_prefix_caching_a_measured_request_shares_no_compressed_context(engine_run):
    """With prefix caching on, the second question about the first context does not take its
    compressed context: each measured request computes and measures its own (its passes' scores are
    the worker's from the first question, the ledger's ``reconstruct_reused``)."""
    ledger = engine_run["ledger"]
    assert ledger.get("shared_contexts", {}).get("hits", 0) == 0
    assert all("context" not in counters for counters in engine_run["request_counters"])

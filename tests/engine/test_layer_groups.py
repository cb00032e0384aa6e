"""The model's layers as G KV cache groups in the real engine (``engine.layer_groups``,
``harness.engine.layer_groups``): SmolLM2's 30 layers as three groups of ten, prefix caching on.

Full cache: each group reads its own block table over the same tokens, so nothing the model
computes may change: the outputs equal one group's, every request holds three times the blocks
(each a third the size), and every block comes back.

Evicting per group: each group keeps its own block list, evicted count, physical lengths and slot
mapping, policy state and query window, and evicts by its own budget. KNorm, SnapKV and H2O choose
per layer and KV head, so at the uniform schedule three groups keep exactly what one group keeps
(SnapKV from each group's own window of queries, H2O counting every query in every group): their
outputs equal G = 1's. PagedEviction
at the pyramid schedule gives each group its own budget (more below): each group's blocks while
generating are its budget's blocks and the one being filled. The prompts repeat across the
policies and one shares a prefix with another, so prefix hits and copy targets happen per group.

At the attention schedule (CAKE's preferences) the worker measures each request's group budgets
from its prompt's last 32 queries in the step that ends the prompt, and evicts by them in that
step: PagedEviction and SnapKV there equal the Hugging Face reference measuring the same way, and
the plain reference evicting each group by the budgets that measurement gave."""
from __future__ import annotations

import pytest

from harness.eviction.settings import group_policies, parse_settings
from tests.support.engine_support import BLOCK, assert_same_outputs, mixed_lengths, run_engine, text_prompts

pytestmark = pytest.mark.engine

GROUPS = 3
NEW_TOKENS = 24
UNIFORM = [{"policy": "knorm", "budget": 64}, {"policy": "snapkv", "budget": 64}, {"policy": "h2o", "budget": 64}]
PAGED_PYRAMID = {"policy": "paged", "budget": 128, "budget_schedule": "pyramid"}
KNORM_PYRAMID = {"policy": "knorm", "budget": 128, "budget_schedule": "pyramid"}
# PyramidKV proper (SnapKV with the pyramid), and H2O counting every query in every group
PYRAMID = [PAGED_PYRAMID, KNORM_PYRAMID, {"policy": "snapkv", "budget": 128, "budget_schedule": "pyramid"},
           {"policy": "h2o", "budget": 128, "budget_schedule": "pyramid"}]
# The Hugging Face reference checks the plumbing, not each score: one policy per path through it
# (attention-free PagedEviction, SnapKV's query capture per group, H2O's totals per group); KNorm
# takes PagedEviction's path and is checked against the plain reference with the rest (CI time)
PYRAMID_PLUMBING = [settings for settings in PYRAMID if settings is not KNORM_PYRAMID]
ATTENTION = [{"policy": "paged", "budget": 128, "budget_schedule": "attention"},
             {"policy": "snapkv", "budget": 128, "budget_schedule": "attention"}]


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of 200-500 tokens and one that repeats the first's first 256 (a prefix hit)."""
    own = text_prompts("smollm2", mixed_lengths(3, 200, 500, seed=11), seed=11)
    return own + [own[0][:256] + own[1][:64]]


def settings_of(groups: int, count: int) -> list:
    """Full cache, KNorm (uniform) and, with several groups, PagedEviction at the pyramid schedule."""
    configs = [{"policy": "full"}, *UNIFORM] + (PYRAMID if groups > 1 else [])
    return [config for config in configs for _ in range(count)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prompts):
    runs = {}
    for groups in (1, GROUPS):
        settings = settings_of(groups, len(prompts))
        runs[groups] = run_engine(tmp_path_factory.mktemp(f"g{groups}"), "smollm2", prompts * (len(settings) // len(prompts)),
                                  NEW_TOKENS, prefix_caching=True, layer_groups=groups, request_eviction=settings)
    return runs


def part(run: dict, index: int, count: int) -> dict:
    """The outputs (and their top log-probabilities) of one configuration of a run."""
    cut = slice(index * count, (index + 1) * count)
    return {"outputs": run["outputs"][cut], "top_logprobs": run["top_logprobs"][cut]}


def test_three_groups_of_ten_contiguous_layers_generate_what_one_group_does(runs, prompts):
    layers = [[int(name.split(".")[2]) for name in group] for group in runs[GROUPS]["kv_cache_groups"]]
    assert layers == [list(range(g * 10, g * 10 + 10)) for g in range(GROUPS)]
    assert len(runs[1]["kv_cache_groups"]) == 1
    assert_same_outputs(part(runs[1], 0, len(prompts)), part(runs[GROUPS], 0, len(prompts)))


@pytest.mark.parametrize("case", range(len(UNIFORM)), ids=[config["policy"] for config in UNIFORM])
def test_evicting_per_group_at_the_uniform_schedule_keeps_what_one_group_keeps(runs, prompts, case):
    assert_same_outputs(part(runs[1], 1 + case, len(prompts)), part(runs[GROUPS], 1 + case, len(prompts)))


def test_paged_at_the_pyramid_schedule_holds_each_groups_own_budget(runs, prompts):
    budgets = [policy.budget for policy in group_policies(parse_settings(PAGED_PYRAMID, "test"), BLOCK, 30, GROUPS)]
    assert sum(budgets) == GROUPS * PAGED_PYRAMID["budget"] and budgets[0] > budgets[1] > budgets[2]
    ledger = runs[GROUPS]["ledger"]
    # every prompt is past 128 tokens: each group keeps its budget after prefill, then fills one more
    # block while generating (24 tokens: no decode eviction yet); the others' 64 hold fewer in every group
    assert ledger["evicting_group_blocks_peak"] == [budget // BLOCK + 1 for budget in budgets]
    # prefill evictions: one per group of every evicting request
    assert ledger["evictions"]["prefill"] == GROUPS * (len(UNIFORM) + len(PYRAMID)) * len(prompts)
    assert runs[1]["ledger"]["evictions"]["prefill"] == len(UNIFORM) * len(prompts)


def test_the_same_memory_holds_three_times_the_blocks_and_every_block_comes_back(runs):
    one, three = runs[1], runs[GROUPS]
    # vLLM's block counts, each its memory divided by a block's bytes rounded down (null block included)
    assert 3 * one["pool_blocks"] <= three["pool_blocks"] < 3 * one["pool_blocks"] + 3
    # the full-cache requests hold the most blocks while generating: three times as many at G = 3
    assert three["ledger"]["decode_blocks_peak"] == GROUPS * one["ledger"]["decode_blocks_peak"] > 0
    for run in (one, three):
        assert run["free_blocks_after"] == run["free_blocks_before"], "every block returns"


@pytest.mark.parametrize("settings", PYRAMID, ids=[settings["policy"] for settings in PYRAMID])
def test_the_pyramid_equals_the_plain_reference_evicting_each_group_by_its_own_budget(runs, prompts, settings):
    """Each group's layers attend over their own number of tokens (the groups' own seq_lens in the
    attention metadata): the plain reference, sharing no code with the harness, evicts each group's
    layers by its own budget with a causal mask per layer (SnapKV from the group's own layers'
    queries, H2O's totals per group)."""
    from tests.support.engine_support import assert_mostly_equal, model_path, plain_policy
    from tests.support.plain_reference import PlainReference

    budgets = [policy.budget for policy in group_policies(parse_settings(settings, "test"), BLOCK, 30, GROUPS)]
    plain = PlainReference(model_path("smollm2"))
    expected = [plain.generate(prompt, NEW_TOKENS, [plain_policy(settings["policy"], budget) for budget in budgets])[0]
                for prompt in prompts]
    index = 1 + len(UNIFORM) + PYRAMID.index(settings)
    assert_mostly_equal(part(runs[GROUPS], index, len(prompts))["outputs"], expected)


@pytest.mark.parametrize("settings", PYRAMID_PLUMBING, ids=[settings["policy"] for settings in PYRAMID_PLUMBING])
def test_the_pyramid_equals_the_hugging_face_reference_evicting_each_group_by_its_own_budget(runs, prompts, settings):
    """The plumbing's oracle: the Hugging Face reference with the harness's own evictor and the
    engine's group policies, each group's layers holding their own tokens under their own causal
    mask, compared with the near-tie rule on its top log-probabilities."""
    from harness.eviction.hf_reference import HFReferenceEngine
    from tests.support.engine_support import model_path

    reference = HFReferenceEngine(model_path("smollm2"), list(group_policies(parse_settings(settings, "test"), BLOCK, 30, GROUPS)))
    expected = [reference.generate_with_top_logprobs(prompt, NEW_TOKENS) for prompt in prompts]
    index = 1 + len(UNIFORM) + PYRAMID.index(settings)
    assert_same_outputs({"outputs": [ids for ids, _ in expected], "top_logprobs": [best for _, best in expected]},
                        part(runs[GROUPS], index, len(prompts)))


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory, prompts):
    """The attention schedule's requests on their own engine (three groups, prefix caching on: these
    requests neither take nor leave cached blocks), so the runs above keep their exact block peaks."""
    settings = [config for config in ATTENTION for _ in prompts]
    return run_engine(tmp_path_factory.mktemp("attention"), "smollm2", prompts * len(ATTENTION), NEW_TOKENS,
                      prefix_caching=True, layer_groups=GROUPS, request_eviction=settings)


@pytest.fixture(scope="module")
def attention_references(prompts):
    """Per attention-schedule settings: the Hugging Face reference's outputs (with top
    log-probabilities) and the budgets it measured for each prompt."""
    from harness.eviction.hf_reference import HFReferenceEngine
    from tests.support.engine_support import model_path

    references = []
    for settings in ATTENTION:
        parsed = parse_settings(settings, "test")
        reference = HFReferenceEngine(model_path("smollm2"), list(group_policies(parsed, BLOCK, 30, GROUPS)), schedule=parsed)
        outputs, best, budgets = [], [], []
        for prompt in prompts:
            ids, top = reference.generate_with_top_logprobs(prompt, NEW_TOKENS)
            outputs.append(ids), best.append(top), budgets.append(reference.measured_budgets)
        references.append({"outputs": outputs, "top_logprobs": best, "budgets": budgets})
    return references


@pytest.mark.parametrize("case", range(len(ATTENTION)), ids=[settings["policy"] for settings in ATTENTION])
def test_the_attention_schedule_equals_the_hugging_face_reference_measuring_alike(attention_run, prompts,
                                                                                 attention_references, case):
    reference = attention_references[case]
    for budgets in reference["budgets"]:
        assert sum(budgets) == GROUPS * ATTENTION[case]["budget"] and len(set(budgets)) > 1, budgets
    assert_same_outputs({key: reference[key] for key in ("outputs", "top_logprobs")}, part(attention_run, case, len(prompts)))


@pytest.mark.parametrize("case", range(len(ATTENTION)), ids=[settings["policy"] for settings in ATTENTION])
def test_the_attention_schedule_equals_the_plain_reference_at_the_measured_budgets(attention_run, prompts,
                                                                                 attention_references, case):
    from tests.support.engine_support import assert_mostly_equal, model_path, plain_policy
    from tests.support.plain_reference import PlainReference

    plain = PlainReference(model_path("smollm2"))
    name = ATTENTION[case]["policy"]
    expected = [plain.generate(prompt, NEW_TOKENS, [plain_policy(name, budget) for budget in budgets])[0]
                for prompt, budgets in zip(prompts, attention_references[case]["budgets"])]
    assert_mostly_equal(part(attention_run, case, len(prompts))["outputs"], expected)


def test_the_attention_schedule_holds_the_measured_blocks_and_returns_every_block(attention_run, prompts,
                                                                                 attention_references):
    """While generating, each group holds its measured budget's blocks and the one being filled (a
    block more where PagedEviction kept the prompt's partial block too; what a prompt shorter than
    the budget holds, if less), at its largest over the requests; a group evicts only a prompt
    longer than its budget, once; every block returns."""
    ledger = attention_run["ledger"]
    budgets = [b for reference in attention_references for b in reference["budgets"]]
    lengths = [len(prompt) for _ in ATTENTION for prompt in prompts]

    def most(extra: int) -> list[int]:
        return [max(min(b[g] // BLOCK + extra, -(-(n + NEW_TOKENS - 1) // BLOCK)) for b, n in zip(budgets, lengths))
                for g in range(GROUPS)]

    peaks = ledger["evicting_group_blocks_peak"]
    assert all(low <= peak <= high for low, peak, high in zip(most(1), peaks, most(2))), (most(1), peaks, most(2))
    assert 0 < ledger["evictions"]["prefill"] <= sum(n > b[g] for b, n in zip(budgets, lengths) for g in range(GROUPS))
    assert attention_run["free_blocks_after"] == attention_run["free_blocks_before"]


# A context compressed once and shared, with three groups at the pyramid schedule (each group its
# own budget, so its own kept count, whole blocks in each: compress=context): the first and the last
# prompt share their first 250 tokens (``prompts``). The same requests with share_context=false,
# in the same engine, compute their own.
SHARED_CONTEXT = {"policy": "paged", "budget": None, "budget_ratio": 0.5, "decode_eviction": False,
                  "compress": "context", "context_tokens": 250, "budget_schedule": "pyramid"}


@pytest.fixture(scope="module")
def shared_context_run(tmp_path_factory, prompts):
    settings = [SHARED_CONTEXT] * len(prompts) + [{**SHARED_CONTEXT, "share_context": False}] * len(prompts)
    return run_engine(tmp_path_factory.mktemp("shared"), "smollm2", prompts * 2, NEW_TOKENS, prefix_caching=True,
                      layer_groups=GROUPS, request_eviction=settings)


def test_a_context_shared_across_three_groups_generates_what_each_request_computing_its_own_does(
        shared_context_run, prompts):
    count = len(prompts)
    assert_same_outputs(part(shared_context_run, 1, count), part(shared_context_run, 0, count))
    ledger = shared_context_run["ledger"]
    assert ledger["shared_contexts"]["hits"] == 1 and ledger["shared_contexts"]["published"] == 3
    # every request but the one that took a context evicts in each group, once
    assert ledger["evictions"]["prefill"] == GROUPS * (2 * count - 1)
    assert shared_context_run["free_blocks_after"] == shared_context_run["free_blocks_before"]

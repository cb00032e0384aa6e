"""The kvzip budget schedule without a model (issue 50): KVzip's own allocation over layer groups.

KVzip's default keeps the top-scoring (layer, head, token) entries of the whole cache, one threshold
across layers and heads; each group of layers gets, as its budget, its layers' entries above that
threshold (``policies.budget_schedules.kvzip_layer_counts``, then ``group_budgets("kvzip")``). Here:
the counts against a hand computation and against sorting every entry, ties split exactly; the
groups' budgets against a hand apportionment; the measurement from the reconstruction scores
(``harness.eviction.layer_budgets.kvzip_measured_settings``); the worker's measuring step
(``worker_patch.reconstruct_due`` on a stand-in model, as ``test_kvzip_passes`` runs the passes); the
Hugging Face reference's measurement; and the refusals, one line each, before any model loads."""
from __future__ import annotations

from contextlib import nullcontext
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from harness.config import ConfigError, run_settings
from harness.eviction.layer_budgets import kvzip_measured_settings
from harness.eviction.settings import (EvictionSettings, admit, check_schedule_runs, group_policies, least_blocks,
                                       parse_settings)
from harness.eviction.shards import SINGLE
from harness.eviction.state import PolicyState
from policies.budget_schedules import apportion, group_budgets, kvzip_layer_counts
from tests.unit.test_kvzip_run import compose_cfg

RECONSTRUCTION = {"prefix_tokens": 6, "first": [11, 12, 13], "later": [21, 22], "suffix": [31]}


def schedule_settings(**changes) -> dict:
    raw = {"policy": "kvzip", "budget": 64, "decode_eviction": False, "compress": "context", "context_tokens": 140,
           "budget_schedule": "kvzip", "reconstruction": RECONSTRUCTION}
    raw.update(changes)
    return {key: value for key, value in raw.items() if value is not None}


# --- the global threshold's counts -------------------------------------------------------------------
def hand_scores() -> torch.Tensor:
    """3 layers, 2 KV heads, 4 tokens."""
    return torch.tensor([
        [[9.0, 8.0, 7.0, 6.0], [5.0, 5.0, 1.0, 0.0]],
        [[4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]],
        [[10.0, 9.5, 5.0, 5.0], [5.0, 0.5, 0.25, 0.0]],
    ])


def test_the_counts_equal_a_hand_computation():
    # 2 per layer and head: the best 12 of 24. Above 5: 10, 9.5, 9, 8, 7, 6 (layer 0: 4, layer 2: 2);
    # the five 5s (layer 0: 2, layer 2: 3) make 11; the 12th is layer 1's 4, alone at the threshold.
    assert kvzip_layer_counts(hand_scores(), 2) == [6, 1, 5]
    # 1 per layer and head: the best 6, all above 5 (4 in layer 0, 2 in layer 2).
    assert kvzip_layer_counts(hand_scores(), 1) == [4, 0, 2]
    # Everything, or more than every token: each layer all its 8 entries; nothing: none.
    assert kvzip_layer_counts(hand_scores(), 4) == kvzip_layer_counts(hand_scores(), 9) == [8, 8, 8]
    assert kvzip_layer_counts(hand_scores(), 0) == [0, 0, 0]
    # Groups given apart (layers 0-1 and 2) are the same layers joined.
    assert kvzip_layer_counts([hand_scores()[:2], hand_scores()[2:]], 2) == [6, 1, 5]


def test_a_tie_at_the_threshold_is_split_in_proportion_exactly():
    scores = hand_scores()
    scores[1, 0, 0] = scores[1, 1, 0] = 5.0  # layer 1 now holds two 5s too: seven entries tie at 5
    # The best 12: six above 5 (layer 0: 4, layer 2: 2), then 6 of the seven 5s (layer 0: 2, layer 1: 2,
    # layer 2: 3), 6/7 of each layer's.
    got = kvzip_layer_counts(scores, 2)
    assert got == [4 + Fraction(12, 7), Fraction(12, 7), 2 + Fraction(18, 7)] and sum(got) == 12


@pytest.mark.parametrize("seed", range(5))
def test_the_counts_are_each_layers_share_of_the_sorted_best(seed):
    """Distinct scores: each layer's count is how many of the layers x heads x kept best entries,
    sorted over every layer and head together, are its own."""
    gen = torch.Generator().manual_seed(seed)
    layers, heads, tokens, kept = 6, 3, 50, 7 + seed
    scores = torch.rand(layers, heads, tokens, generator=gen) ** (1 + torch.arange(layers)[:, None, None])
    best = scores.reshape(-1).argsort(descending=True)[: layers * heads * kept]
    expected = torch.bincount(best // (heads * tokens), minlength=layers).tolist()
    assert kvzip_layer_counts(scores, kept) == expected


def test_counts_refuse_what_is_not_scores():
    with pytest.raises(ValueError, match=r"\[layers, kv_heads, tokens\]"):
        kvzip_layer_counts(torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match="kept_per_layer must be an integer >= 0"):
        kvzip_layer_counts(hand_scores(), -1)
    with pytest.raises(ValueError, match="finite"):
        kvzip_layer_counts(torch.full((2, 1, 3), float("nan")), 1)


# --- the groups' budgets -----------------------------------------------------------------------------
def test_group_budgets_follow_the_counts_as_a_hand_apportionment():
    # 4 layers as 2 groups, 2 blocks of 4 per group: 4 blocks. Shares 10 + 6 = 16 and 1 + 1 = 2:
    # 4 x 16/18 = 3.56 and 0.44 blocks; floors 3 and 0, the leftover to the larger remainder: 4 and 0.
    assert group_budgets("kvzip", 8, 4, 2, 4, counts=[10, 6, 1, 1], min_blocks=0) == (16, 0)
    # A floor of one block: 3 and 1; a cap of 3 blocks (10 tokens take 3): the same.
    assert group_budgets("kvzip", 8, 4, 2, 4, counts=[10, 6, 1, 1], min_blocks=1) == (12, 4)
    assert group_budgets("kvzip", 8, 4, 2, 4, counts=[10, 6, 1, 1], min_blocks=0, cap_tokens=10) == (12, 4)
    # Equal counts are the uniform schedule; one group per layer gives each layer its own budget.
    assert group_budgets("kvzip", 8, 4, 2, 4, counts=[3, 3, 3, 3]) == group_budgets("uniform", 8, 4, 2, 4)
    assert group_budgets("kvzip", 12, 3, 3, 4, counts=[6, 2, 1], min_blocks=0) == (24, 8, 4)
    with pytest.raises(ValueError, match="needs one kept count per layer"):
        group_budgets("kvzip", 8, 4, 2, 4, counts=[1, 2])
    with pytest.raises(ValueError, match="non-negative"):
        group_budgets("kvzip", 8, 4, 2, 4, counts=[1, 2, -1, 0])


def test_the_measured_budgets_are_whole_blocks_summing_to_the_uniform_total():
    """Two groups of 2 layers, 2 heads, a context of 140 tokens (5 blocks of 32), the first group's
    scores all above the second's, a group's floor two blocks (KVzip's least budget)."""
    gen = torch.Generator().manual_seed(0)
    high, low = torch.rand(2, 2, 140, generator=gen) + 1, torch.rand(2, 2, 140, generator=gen)
    settings = EvictionSettings(**schedule_settings(budget=96))
    assert least_blocks(settings, 32) == 2
    # 96 a layer and head (3 blocks, 6 in all): the best 4 x 2 x 96 = 768 entries are the first group's
    # 560 and 208 of the second's: 6 x 560/768 = 4.375 and 1.625 blocks; the second is raised to its
    # floor of 2, the first takes the other 4.
    measured = kvzip_measured_settings(settings, [high, low], 32, 140, 4, 2)
    assert measured.group_budgets == (128, 64) and not measured.measuring and measured.key != settings.key
    assert [p.budget for p in group_policies(measured, 32, 4, 2)] == [128, 64]
    # 64 (2 blocks a group): the floors take all 4 blocks, whatever the scores say.
    assert kvzip_measured_settings(EvictionSettings(**schedule_settings()), [high, low], 32, 140, 4, 2
                                   ).group_budgets == (64, 64)
    # No pass ran (the uniform budget holds the whole context): equal shares, each capped at the context.
    whole = EvictionSettings(**schedule_settings(budget=160))
    assert kvzip_measured_settings(whole, None, 32, 140, 4, 2).group_budgets == (160, 160)
    with pytest.raises(ValueError, match="for 2 groups of 4 layers"):
        kvzip_measured_settings(settings, [high], 32, 140, 4, 2)


def test_the_measured_budgets_are_the_threshold_counts_apportioned():
    settings = EvictionSettings(**schedule_settings(budget=96))
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(4, 2, 140, generator=gen) ** torch.tensor([1.0, 2.0, 4.0, 8.0])[:, None, None]
    counts = kvzip_layer_counts(scores, 96)
    shares = [counts[0] + counts[1], counts[2] + counts[3]]
    expected = tuple(b * 32 for b in apportion(shares, 6, least_blocks(settings, 32), 5))
    assert kvzip_measured_settings(settings, [scores[:2], scores[2:]], 32, 140, 4, 2).group_budgets == expected
    assert sum(expected) == 2 * 96 and expected[0] > expected[1], (counts, expected)


# --- refusals ----------------------------------------------------------------------------------------
def admitted(raw: dict, groups: int = 2, async_scheduling: bool = False):
    settings = parse_settings(raw, "request").for_prompt(200, 32)
    return admit(settings, 32, 30, groups, enforce_eager=True, async_scheduling=async_scheduling)


def test_the_schedule_is_admitted_with_kvzip_and_context_compression():
    policies = admitted(schedule_settings())
    assert [p.budget for p in policies] == [64, 64]  # the uniform budgets until measured
    assert parse_settings(schedule_settings(), "r").measuring
    admitted(schedule_settings(budget=None, budget_ratio=0.5))
    admitted(schedule_settings(options={"granularity": "block"}))


@pytest.mark.parametrize("changes, groups, async_scheduling, message", [
    ({"policy": "knorm", "reconstruction": None}, 2, False, "policy knorm computes none: use policy=kvzip"),
    ({"compress": "prompt", "context_tokens": None}, 2, False, "compress=context only"),
    ({}, 2, True, "synchronous scheduling"),
    ({}, 1, False, "budget_schedule=kvzip spreads the budget over the engine's layer groups; this engine has one"),
    ({"budget_schedule": "attention"}, 2, False, "use uniform, pyramid or kvzip"),
])
def test_what_it_cannot_run_is_refused_with_one_line(changes, groups, async_scheduling, message):
    with pytest.raises(ValueError, match=message) as refused:
        admitted(schedule_settings(**changes), groups, async_scheduling)
    assert "\n" not in str(refused.value)


def test_a_shared_context_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="budget_schedule=kvzip measures each request's layer budgets"):
        parse_settings(schedule_settings(share_context=True), "request")


def test_the_default_stays_uniform():
    settings = parse_settings(schedule_settings(budget_schedule=None), "request")
    assert settings.budget_schedule == "uniform" and not settings.measuring
    check_schedule_runs(settings, enforce_eager=True, async_scheduling=True)  # uniform asks nothing of the engine


KVZIP_RUN = ("policy=kvzip", "compress=context", "budget_ratio=0.5", "engine.layer_groups=2", "budget_schedule=kvzip")


def test_the_run_admits_it_and_refuses_what_it_cannot_run_before_any_model_loads():
    run = run_settings(compose_cfg(*KVZIP_RUN))
    assert run.eviction.budget_schedule == "kvzip" and run.eviction.slug().endswith("_context_kvzip")
    for overrides, message in [(["policy=knorm"], "computes none"),
                               (["compress=prompt", "decode_eviction=false"], "compress=context only"),
                               (["engine.async_scheduling=true"], "synchronous scheduling"),
                               (["engine.layer_groups=1"], "this engine has one")]:
        with pytest.raises(ConfigError, match=message) as refused:
            run_settings(compose_cfg(*KVZIP_RUN, *overrides))
        assert "\n" not in str(refused.value)


# --- the worker's measuring step -----------------------------------------------------------------------
def worker_case(budget: int):
    """A stand-in model of 4 layers as 2 KV cache groups (``test_kvzip_passes``), one request whose
    prefill reaches its 40-token context's end this step, at the kvzip schedule."""
    from harness.engine.backend_views import FlashAttnView
    from harness.engine.reconstruction import Reconstruction
    from harness.engine.worker_patch import WorkerEviction
    from harness.eviction.messages import PLAN_ATTRIBUTE, EvictionPlan
    from tests.unit.test_kvzip_passes import BLOCK, DIM, KV_HEADS, LAYERS, SCALE, VOCAB, TinyModel, cached_request

    context = torch.randint(8, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    c = len(context)
    model = TinyModel()
    caches = [torch.zeros(8, KV_HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    for layer, (_, k, v) in enumerate(model.whole(context)):
        view = FlashAttnView([caches[layer]])
        positions = torch.arange(c)
        view.write_layer(0, positions // BLOCK, positions % BLOCK, k.transpose(0, 1).contiguous(),
                         v.transpose(0, 1).contiguous())
    views = [FlashAttnView(caches[:2]), FlashAttnView(caches[2:])]
    runner = SimpleNamespace(device=torch.device("cpu"), model=model, vllm_config=None,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=64))
    settings = EvictionSettings("kvzip", budget, {"chunk_size": 16}, decode_eviction=False, compress="context",
                                context_tokens=c, budget_schedule="kvzip",
                                reconstruction={"prefix_tokens": 2, "first": [1, 2], "later": [3], "suffix": [4]})
    state = SimpleNamespace(
        views=views, reconstruction=Reconstruction(runner, list(model.attn), [SCALE] * LAYERS, views, [[0, 1], [2, 3]], SINGLE,
                                      forward_context=lambda tokens: nullcontext()),
        policy_for=lambda s: admit(s, BLOCK, LAYERS, 2, enforce_eager=True, async_scheduling=False),
        groups=2, group_layers=[[0, 1], [2, 3]], block_size=BLOCK, measured={},
        policy_states=[PolicyState(), PolicyState()])
    state.settings_of = lambda rid, s: WorkerEviction.settings_of(state, rid, s)
    request = cached_request(context + [5, 6], (list(range(5)), list(range(5))), 24)
    step = SimpleNamespace(num_scheduled_tokens={"r": c - 24})
    step.__dict__[PLAN_ATTRIBUTE] = EvictionPlan(None, {"r": settings})
    return SimpleNamespace(requests={"r": request}), state, step, settings, c


def test_the_worker_measures_from_the_passes_scores_and_evicts_by_them():
    """The budgets ``reconstruct_due`` reports are those of the passes' own scores (run again apart):
    whole blocks summing to the uniform total, differing as the counts do; they are kept for the
    step's eviction (``settings_of``); a group whose budget holds the whole context keeps no scores."""
    from harness.engine.worker_patch import reconstruct_due
    from tests.unit.test_kvzip_passes import BLOCK

    runner, state, step, settings, c = worker_case(4 * BLOCK)  # 4 blocks a group, 8 in all; 5 hold the context
    budgets, failures = {}, {}
    done = reconstruct_due(runner, state, step, failures, budgets)
    assert not failures and done.tokens > 0
    again = [PolicyState(), PolicyState()]
    state.reconstruction.run("r", runner.requests["r"], settings, state.policy_for(settings), again)
    counts = kvzip_layer_counts([again[0].scores["r"], again[1].scores["r"]], settings.budget)
    expected = tuple(b * BLOCK for b in apportion([counts[0] + counts[1], counts[2] + counts[3]], 8,
                                                  least_blocks(settings, BLOCK), 5))
    assert budgets == {"r": expected} and sum(expected) == 2 * 4 * BLOCK
    # (this model's first layers keep more above the threshold: the first group takes the whole context)
    assert expected == (5 * BLOCK, 3 * BLOCK), (counts, expected)
    measured = state.settings_of("r", settings)
    assert measured.group_budgets == expected and not measured.measuring
    for group, budget in enumerate(expected):  # scores where the group evicts, none where it keeps all
        assert ("r" in state.policy_states[group].scores) == (budget < c)
    # The step's eviction (the worker's evict_step) by the measured budgets: the second group keeps
    # exactly its 3 blocks, the first all 5 (nothing to evict, no scores asked for).
    from harness.eviction.step import StepRequest, evict_step

    blocks = [list(range(5)), list(range(5))]
    changed = evict_step(state.views, state.policy_states, [StepRequest("r", state.policy_for(measured), blocks, c,
                                                                         24, c, (0, 0))])
    assert set(changed) == {("r", 1)} and changed[("r", 1)].evicted_tokens == c - 3 * BLOCK
    assert len(blocks[0]) == 5 and len(blocks[1]) == 3


def test_the_worker_runs_no_pass_where_the_uniform_budget_holds_the_context():
    from harness.engine.worker_patch import reconstruct_due
    from tests.unit.test_kvzip_passes import BLOCK

    runner, state, step, settings, c = worker_case(5 * BLOCK)  # 40 tokens: the whole context
    budgets = {}
    done = reconstruct_due(runner, state, step, {}, budgets)
    assert done.tokens == 0 and budgets == {"r": (5 * BLOCK, 5 * BLOCK)}
    assert not state.policy_states[0].scores and not state.policy_states[1].scores


# --- the Hugging Face reference's measurement (its method alone: no model) ----------------------------
def test_the_hugging_face_reference_measures_as_the_worker():
    from harness.eviction.hf_reference import HFReferenceEngine

    settings = parse_settings(schedule_settings(budget=96, context_tokens=None, reconstruction=None), "test")
    reference = object.__new__(HFReferenceEngine)
    reference.schedule, reference.prompt_tokens = settings, 180
    reference.policies = group_policies(settings, 32, 4, 2)
    reference.policy = reference.policies[0]
    reference.attention_layers = [None] * 4
    reference.group_layers = [range(0, 2), range(2, 4)]
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(4, 2, 140, generator=gen) ** torch.tensor([1.0, 2.0, 4.0, 8.0])[:, None, None]
    reference._measure_kvzip(scores, 140, RECONSTRUCTION)
    request = EvictionSettings(**schedule_settings(budget=96))
    expected = kvzip_measured_settings(request, [scores[:2], scores[2:]], 32, 140, 4, 2).group_budgets
    assert reference.measured_budgets == expected and len(set(expected)) > 1
    assert [p.budget for p in reference.policies] == list(expected)

"""Budget schedules over groups of layers, against hand computations and kvpress's formula (no engine)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from policies.budget_schedules import SCHEDULES, apportion, group_budgets, layer_preferences, pyramid_layer_budgets

LAYERS = 30
BLOCK = 16


def kvpress_budget(mean: float, layers: int, layer: int, beta: float) -> float:
    """PyramidKV's per-layer budget written out in floats, as kvpress's get_layer_budget computes it
    before rounding (no cap: the window and sequence-length terms do not bind)."""
    min_num = mean / beta
    max_num = 2 * mean - min_num
    return max_num - layer * (max_num - min_num) / (layers - 1)


def some_preferences(layers: int, seed: int) -> list[float]:
    """Positive, zero and tiny preferences mixed, reproducibly."""
    rng = random.Random(seed)
    return [rng.choice([0.0, 1e-9, rng.random(), 10 * rng.random()]) for _ in range(layers)]


def attention_rows(rows: list[list[float]], heads: int = 2) -> torch.Tensor:
    """One layer's [heads, window, keys] attention, every head the same, rows normalised."""
    weights = torch.tensor(rows, dtype=torch.float32)
    return (weights / weights.sum(dim=-1, keepdim=True)).expand(heads, -1, -1)


def budgets(schedule: str, budget_blocks: int, groups: int, layers: int = LAYERS, block_size: int = BLOCK, **kw):
    if schedule == "attention" and "preferences" not in kw:
        kw["preferences"] = some_preferences(layers, seed=budget_blocks * 100 + groups)
    if schedule == "kvzip" and "counts" not in kw:  # kept entries per layer (kvzip_layer_counts), zeros too
        rng = random.Random(budget_blocks * 100 + groups)
        kw["counts"] = [rng.choice([0, 1, rng.randrange(1000)]) for _ in range(layers)]
    return group_budgets(schedule, budget_blocks * block_size, layers, groups, block_size, **kw)


# --- uniform and conservation ----------------------------------------------------------------------
@pytest.mark.parametrize("groups", [1, 2, 3, 5, 6, 10, 15, 30])
@pytest.mark.parametrize("budget_blocks", [1, 2, 32])
def test_uniform_gives_every_group_the_budget(groups, budget_blocks):
    assert budgets("uniform", budget_blocks, groups) == (budget_blocks * BLOCK,) * groups


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_every_schedule_conserves_the_total_in_blocks(schedule, block_size):
    for budget_blocks in [1, 2, 3, 5, 32]:
        for groups in [1, 2, 3, 4, 6, 12]:
            for min_blocks in [0, 1, 2, 3]:
                if min_blocks > budget_blocks:
                    continue
                got = budgets(schedule, budget_blocks, groups, 12, block_size, min_blocks=min_blocks)
                case = (budget_blocks, groups, min_blocks, got)
                assert len(got) == groups, case
                assert all(tokens % block_size == 0 for tokens in got), case
                assert sum(got) == groups * budget_blocks * block_size, case
                assert min(got) >= min_blocks * block_size, case


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("min_blocks", [2, 3, 10])
def test_a_floor_above_the_budget_raises(schedule, min_blocks):
    with pytest.raises(ValueError, match=f"min_blocks={min_blocks} is more than the uniform budget of 1 blocks"):
        budgets(schedule, 1, 5, min_blocks=min_blocks)


# --- pyramid ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [1.0, 1.5, 4.0, 20.0, 100.0])
@pytest.mark.parametrize("groups", [2, 3, 5, 10, 30])
@pytest.mark.parametrize("budget_blocks", [1, 2, 3, 8, 32])
def test_pyramid_never_gives_a_later_group_more(beta, groups, budget_blocks):
    got = budgets("pyramid", budget_blocks, groups, beta=beta)
    assert all(a >= b for a, b in zip(got, got[1:])), got


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 6, 10, 15, 30])
def test_pyramid_with_beta_one_is_uniform(groups):
    assert set(pyramid_layer_budgets(512, LAYERS, beta=1.0)) == {512}
    assert budgets("pyramid", 32, groups, beta=1.0) == budgets("uniform", 32, groups)


@pytest.mark.parametrize("beta", [2.0, 5.0, 20.0])
@pytest.mark.parametrize("layers", [2, 12, 30])
def test_pyramid_one_layer_per_group_is_kvpress_formula_rounded_to_blocks(beta, layers):
    budget = 32 * BLOCK  # b / beta >= one block: the floor of one block does not bind
    got = group_budgets("pyramid", budget, layers, layers, BLOCK, beta=beta)
    formula = [kvpress_budget(budget, layers, layer, beta) for layer in range(layers)]
    assert [float(b) for b in pyramid_layer_budgets(budget, layers, beta)] == pytest.approx(formula)
    assert all(abs(ours - theirs) < BLOCK for ours, theirs in zip(got, formula)), (got, formula)
    assert got[0] > got[-1]


@pytest.mark.parametrize("beta", [0.5, 0.0, -1.0, math.nan, math.inf])
def test_pyramid_beta_below_one_raises(beta):
    with pytest.raises(ValueError, match="beta must be a number >= 1"):
        budgets("pyramid", 4, 3, beta=beta)


# --- the cap ---------------------------------------------------------------------------------------
def test_capped_group_gives_its_surplus_to_the_others_in_proportion():
    # Shares 6:3:1 of 30 blocks are 18, 9, 3; the cap of 15 moves 3 blocks, split 3:1 into 11.25 and
    # 3.75; Hamilton's one leftover block goes to the largest remainder (0.75): 15, 11, 4.
    expected = (15 * 4, 11 * 4, 4 * 4)
    for cap_tokens in [60, 57]:  # 57 tokens still take 15 blocks of 4
        got = group_budgets("attention", 40, 3, 3, 4, preferences=[6.0, 3.0, 1.0], cap_tokens=cap_tokens)
        assert got == expected
    assert group_budgets("attention", 40, 3, 3, 4, preferences=[6.0, 3.0, 1.0]) == (72, 36, 12)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("groups", [2, 3, 6])
@pytest.mark.parametrize("cap_blocks", [9, 10, 12, 20])
def test_cap_is_never_exceeded_and_the_total_is_kept_while_it_can_be(schedule, groups, cap_blocks):
    free = budgets(schedule, 8, groups, 6)
    capped = budgets(schedule, 8, groups, 6, cap_tokens=cap_blocks * BLOCK)
    assert max(capped) <= cap_blocks * BLOCK
    assert sum(capped) == sum(free) == groups * 8 * BLOCK
    # Groups the cap did not reach lose nothing (up to one block of rounding).
    assert all(c >= f - BLOCK for c, f in zip(capped, free) if c < cap_blocks * BLOCK)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_when_every_group_is_capped_the_total_is_less(schedule):
    got = budgets(schedule, 8, 5, cap_tokens=50)  # 50 tokens: 4 blocks of 16
    assert got == (4 * BLOCK,) * 5
    assert budgets(schedule, 8, 5, min_blocks=3, cap_tokens=10) == (BLOCK,) * 5  # floor above the cap


def test_groups_without_a_share_split_what_the_capped_ones_leave():
    # [1, 0, 0] of 9 blocks in [1, 4]: the first is capped at 4, the other two split 5 evenly (3, 2).
    assert apportion([1, 0, 0], 9, low=1, high=4) == [4, 3, 2]


def test_equal_remainders_go_to_the_earlier_group():
    assert apportion([1, 1, 2], 6) == [2, 1, 3]
    got = group_budgets("attention", 2 * BLOCK, 3, 3, BLOCK, preferences=[1.0, 1.0, 2.0], min_blocks=0)
    assert got == (2 * BLOCK, BLOCK, 3 * BLOCK)


# --- attention-derived (CAKE) ----------------------------------------------------------------------
def test_preference_is_entropy_times_shift():
    # Two queries of one head, (1/2, 1/2, 0) and (0, 1/2, 1/2): each row's entropy is ln 2, H = 2 ln 2;
    # key 0 and key 2 take 1/2 and 0 (unbiased variance 1/8), key 1 stays at 1/2, so V = 1/4.
    layer = attention_rows([[1, 1, 0], [0, 1, 1]], heads=1)
    assert layer_preferences([layer]) == pytest.approx([2 * math.log(2) * 0.25])
    assert layer_preferences([layer], tau1=2.0, tau2=0.5) == pytest.approx([(2 * math.log(2)) ** 0.5 * 0.25**2])
    # Heads add: two identical heads double each sum.
    assert layer_preferences([layer.repeat(2, 1, 1)]) == pytest.approx([4 * math.log(2) * 0.5])


def test_spread_shifting_attention_outranks_a_fixed_sink():
    window, keys = 4, 8
    sink = attention_rows([[1] + [0] * (keys - 1)] * window)
    # Causal rows (zeros past each query) that spread over more keys as the queries move on.
    spread = attention_rows([[1] * (keys - window + q + 1) + [0] * (window - q - 1) for q in range(window)])
    preferences = layer_preferences([sink, spread, spread, sink])
    assert preferences[0] == preferences[3] == 0.0
    assert preferences[1] == preferences[2] > 0.0
    assert group_budgets("attention", 4 * BLOCK, 4, 4, BLOCK, preferences=preferences) == (
        BLOCK, 7 * BLOCK, 7 * BLOCK, BLOCK)
    # Two groups of two layers each hold one sink and one spread layer: equal shares.
    assert group_budgets("attention", 4 * BLOCK, 4, 2, BLOCK, preferences=preferences) == (4 * BLOCK,) * 2


def test_all_zero_preferences_are_uniform():
    assert budgets("attention", 3, 5, preferences=[0.0] * LAYERS) == budgets("uniform", 3, 5)


# --- arguments -------------------------------------------------------------------------------------
def test_unknown_schedule_names_the_valid_ones():
    with pytest.raises(ValueError, match="the schedules are uniform, pyramid, attention"):
        group_budgets("cake", 64, 30, 3, BLOCK)


@pytest.mark.parametrize("args, kwargs, message", [
    (("attention", 64, 30, 3, BLOCK), {}, "one preference per layer"),
    (("attention", 64, 30, 3, BLOCK), {"preferences": [1.0] * 29}, "one preference per layer"),
    (("attention", 64, 30, 3, BLOCK), {"preferences": [-1.0] + [1.0] * 29}, "finite and non-negative"),
    (("uniform", 64, 30, 4, BLOCK), {}, "must divide num_layers"),
    (("uniform", 64, 30, 60, BLOCK), {}, "must divide num_layers"),
    (("uniform", 72, 30, 3, BLOCK), {}, "not a whole number"),
    (("uniform", 8, 30, 3, BLOCK), {}, "budget_tokens must be an integer >= 16"),
    (("uniform", 64, 30, 3, BLOCK), {"cap_tokens": 0}, "cap_tokens must be"),
    (("uniform", 64, 30, 3, BLOCK), {"min_blocks": -1}, "min_blocks must be"),
])
def test_invalid_arguments_raise(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_budgets(*args, **kwargs)

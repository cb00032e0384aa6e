"""Policy decisions on hand-made tensors whose answer is known by construction (no engine)."""
from __future__ import annotations

import pytest
import torch

from policies import REGISTRY, BudgetError, default_options, make_policy
from tests.support import ROOT
from tests.support.policy_matrix import MATRIX, MATRIX_IDS
from tests.support.policy_probe import decode_evict_block, decode_keep, prefill_keep, scores_of

B = 4
LAYERS, HEADS, DIM = 2, 3, 8


def kv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, tokens, HEADS, DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def with_norms(key_norm: torch.Tensor, value_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V whose per-token norms are given ([tokens]), equal across layers and heads."""
    direction = torch.zeros(DIM)
    direction[0] = 1.0
    keys = key_norm.view(1, -1, 1, 1) * direction
    values = value_norm.view(1, -1, 1, 1) * direction
    return keys.expand(LAYERS, -1, HEADS, -1).clone(), values.expand(LAYERS, -1, HEADS, -1).clone()


@pytest.mark.parametrize("name", ["paged", "streaming", "knorm", "keydiff"])
@pytest.mark.parametrize("budget", [8, 12, 16])
@pytest.mark.parametrize("tokens", [9, 12, 13, 16, 17, 23, 31])
def test_prefill_kept_counts_are_exact(name, budget, tokens):
    policy = make_policy(name, budget=budget, block_size=B)
    if not policy.needs_prefill_eviction(tokens):
        assert tokens <= budget
        return
    kept = prefill_keep(policy, *kv(tokens))
    expected = budget + tokens % B if name == "paged" else budget
    assert kept.shape == (LAYERS, HEADS, expected)
    assert policy.prefill_keep_count(tokens) == expected
    assert (kept.diff(dim=-1) > 0).all(), "indices sorted and unique"
    assert kept.min() >= 0 and kept.max() < tokens


@pytest.mark.parametrize("name", ["paged", "streaming", "knorm", "keydiff"])
def test_nothing_evicted_at_or_below_budget(name):
    policy = make_policy(name, budget=16, block_size=B)
    assert not policy.needs_prefill_eviction(16)
    assert not policy.needs_prefill_eviction(5)
    assert policy.needs_prefill_eviction(17)


def test_decode_trigger_is_when_newest_block_fills_past_budget():
    policy = make_policy("paged", budget=16, block_size=B)
    fired = [n for n in range(1, 40) if policy.needs_decode_eviction(n)]
    assert fired == [20, 24, 28, 32, 36]
    assert not make_policy("full", budget=16, block_size=B).needs_decode_eviction(20)


def test_paged_prefill_keeps_first_block_last_tokens_and_best_middle():
    tokens, budget = 23, 12  # L mod B = 3: keep first 4, last 4 + 3, best 4 of the middle
    value_norm = torch.ones(tokens)
    value_norm[[6, 9, 10, 13]] = 5.0  # the four best middle tokens by ||V||/||K||
    keys, values = with_norms(torch.ones(tokens), value_norm)
    kept = prefill_keep(make_policy("paged", budget=budget, block_size=B), keys, values)
    expected = [0, 1, 2, 3, 6, 9, 10, 13, 16, 17, 18, 19, 20, 21, 22]
    assert kept[0, 0].tolist() == expected
    assert (kept == kept[0, 0]).all(), "shared across layers and heads by default"


def test_paged_score_is_value_over_key_norm():
    tokens = 17
    key_norm = torch.ones(tokens)
    key_norm[5] = 0.1  # small key norm -> high score
    value_norm = torch.ones(tokens)
    value_norm[7] = 0.1  # small value norm -> low score
    keys, values = with_norms(key_norm, value_norm)
    kept = prefill_keep(make_policy("paged", budget=12, block_size=B), keys, values)[0, 0].tolist()
    # first block, last 4 + 17 mod 4 tokens, and the 4 best of the middle: 5, then ties by position
    assert kept == [0, 1, 2, 3, 4, 5, 6, 8, 12, 13, 14, 15, 16]


def test_paged_per_head_selection_may_differ_between_heads():
    keys, values = kv(23, seed=3)
    kept = prefill_keep(make_policy("paged", budget=12, block_size=B, per_head=True), keys, values)
    assert kept.shape == (LAYERS, HEADS, 15)
    assert len({tuple(row.tolist()) for row in kept.reshape(-1, 15)}) > 1


def test_paged_decode_evicts_argmin_block_never_first_or_newest():
    # 5 blocks of 4 tokens; block scores 0.1 (block 0), 3, 1, 2, 0.1 (newest): argmin among 1..3 is 2
    per_block = torch.tensor([0.1, 3.0, 1.0, 2.0, 0.1]).repeat_interleave(B)
    keys, values = with_norms(torch.ones(20), per_block)
    policy = make_policy("paged", budget=16, block_size=B)
    assert decode_evict_block(policy, keys, values) == 2


def test_paged_decode_ties_break_to_oldest_candidate():
    keys, values = with_norms(torch.ones(24), torch.ones(24))
    assert decode_evict_block(make_policy("paged", budget=20, block_size=B), keys, values) == 1


def test_paged_local_candidates_are_the_oldest_blocks_after_the_first():
    per_block = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.5, 1.0]).repeat_interleave(B)
    keys, values = with_norms(torch.ones(24), per_block)
    assert decode_evict_block(make_policy("paged", budget=20, block_size=B), keys, values) == 4
    local = make_policy("paged", budget=20, block_size=B, candidates="local", local_blocks=3)
    assert decode_evict_block(local, keys, values) == 1


def test_paged_zero_key_norm_gives_finite_scores():
    key_norm = torch.ones(20)
    key_norm[9] = 0.0
    keys, values = with_norms(key_norm, torch.ones(20))
    policy = make_policy("paged", budget=16, block_size=B)
    scores = scores_of(policy, keys, values)
    assert torch.isfinite(scores).all()
    assert decode_evict_block(policy, keys, values) in (1, 2, 3)
    assert prefill_keep(policy, *with_norms(key_norm[:19], torch.ones(19)))[0, 0].tolist().count(9) == 1


def test_paged_single_layer_scoring():
    keys, values = kv(23, seed=5)
    keys[1] *= 100  # layer 1 would change the choice if it were averaged in
    only_first = prefill_keep(make_policy("paged", budget=12, block_size=B, score_layers=0), keys, values)
    reference = prefill_keep(make_policy("paged", budget=12, block_size=B), keys[:1], values[:1])
    assert torch.equal(only_first[0], reference[0])


def test_streaming_keeps_sinks_and_recent_window():
    keys, values = kv(30)
    kept = prefill_keep(make_policy("streaming", budget=12, block_size=B, n_sink=4), keys, values)
    assert kept[0, 0].tolist() == [0, 1, 2, 3] + list(range(22, 30))
    decode = decode_keep(make_policy("streaming", budget=12, block_size=B), *kv(16))
    assert decode[1, 2].tolist() == [0, 1, 2, 3] + list(range(8, 16))


def test_knorm_keeps_lowest_key_norms_per_head():
    tokens = 20
    keys, values = kv(tokens, seed=1)
    scale = torch.ones(LAYERS, tokens, HEADS, 1) * 10
    low = {0: [5, 6, 7, 8], 1: [9, 10, 11, 12], 2: [4, 13, 14, 15]}
    for head, idx in low.items():
        scale[:, idx, head] = 0.01
    keys = keys / torch.linalg.vector_norm(keys, dim=-1, keepdim=True) * scale
    kept = prefill_keep(make_policy("knorm", budget=12, block_size=B), keys, values)
    for head, idx in low.items():
        assert kept[0, head].tolist() == [0, 1, 2, 3] + idx + [16, 17, 18, 19]


def test_keydiff_keeps_keys_least_similar_to_mean():
    tokens = 16
    keys = torch.zeros(LAYERS, tokens, HEADS, DIM)
    keys[..., 0] = 1.0  # every key points the same way ...
    outliers = [5, 9, 10, 11]
    keys[:, outliers, :, 0] = -1.0  # ... but these point away from the mean
    keys[:, outliers, :, 1] = 0.5
    kept = decode_keep(make_policy("keydiff", budget=12, block_size=B), keys, torch.ones_like(keys))
    middle = kept[0, 0, 4:8].tolist()
    assert middle == outliers


def test_keydiff_anchor_is_the_mean_of_normalized_keys():
    """Twelve short keys point along e0, four very long ones along e1. The mean of the raw keys
    points along e1 (it would evict the long keys as "typical"); the mean of the normalized keys
    points mostly along e0, so the published KeyDiff keeps the four long, distinct keys."""
    tokens, long_keys = 16, [5, 6, 8, 9]
    keys = torch.zeros(LAYERS, tokens, HEADS, DIM)
    keys[..., 0] = 0.1
    keys[:, long_keys, :, 0] = 0.0
    keys[:, long_keys, :, 1] = 100.0
    kept = decode_keep(make_policy("keydiff", budget=12, block_size=B), keys, torch.ones_like(keys))
    assert kept[0, 0, 4:8].tolist() == long_keys
    assert (kept == kept[0, 0]).all()


def test_shared_selection_is_identical_for_every_layer_and_head():
    kept = prefill_keep(make_policy("knorm", budget=8, block_size=B, per_head=False), *kv(21))
    assert (kept == kept[0, 0]).all()


@pytest.mark.parametrize(
    "budget, message",
    [(4, "below two blocks"), (10, "not a multiple"), (0, "below two blocks"), (12.0, "integer")],
)
def test_bad_budgets_are_clear_errors(budget, message):
    with pytest.raises(BudgetError, match=message):
        make_policy("paged", budget=budget, block_size=B)


def test_unknown_policy_and_option_list_valid_choices():
    with pytest.raises(ValueError, match="valid: full, h2o, hybrid, keydiff, keydiff_block"):
        make_policy("oracle", budget=8, block_size=B)
    with pytest.raises(ValueError, match="no option n_sinks"):
        make_policy("streaming", budget=8, block_size=B, n_sinks=4)


def test_every_policy_states_its_granularity():
    for name, entry in REGISTRY.items():
        assert make_policy(name, budget=64, block_size=32).granularity == entry.granularity, name
    assert {name for name, entry in REGISTRY.items() if entry.alias_of} >= {"paged_token", "knorm_block", "keydiff_block"}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_the_config_a_policy_starts_from_is_the_codes_default(name):
    """``policy=<name>`` composes the registry's defaults, and building from them gives the policy
    built with no options at all: a config default and the code cannot disagree."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        node = OmegaConf.to_container(compose("config", overrides=[f"policy={name}"]).policy)
    assert node == {"name": name, "options": default_options(name)}
    assert make_policy(name, 256, 32, **node["options"]) == make_policy(name, 256, 32)


def test_granularity_is_an_option_of_every_score_and_aliases_keep_old_names():
    for name, entry in REGISTRY.items():
        if entry.score is None or entry.fixed_granularity:
            continue
        for granularity in ("token", "block"):
            assert make_policy(name, 256, 32, granularity=granularity).granularity == granularity
    # A config that switched granularity (its node still holds the block defaults) is the alias.
    switched = make_policy("paged", 256, 32, **{**default_options("paged"), "granularity": "token"})
    assert switched == make_policy("paged_token", 256, 32)
    with pytest.raises(ValueError, match="no option candidates"):
        make_policy("paged", 256, 32, granularity="token", candidates="local")
    with pytest.raises(ValueError, match="paged_token' is paged at token granularity"):
        make_policy("paged_token", 256, 32, granularity="block")


@pytest.mark.parametrize("block_name, token_name", [("paged", "paged_token"), ("knorm_block", "knorm"),
                                                    ("keydiff_block", "keydiff")])
def test_each_score_at_block_and_token_granularity_shares_its_score(block_name, token_name):
    """Score and granularity apart: the block and token variants of a score rank tokens the same
    way; only what they do with the ranking differs."""
    keys, values = kv(40, seed=7)
    block = make_policy(block_name, budget=16, block_size=B)
    token = make_policy(token_name, budget=16, block_size=B)
    assert torch.equal(scores_of(block, keys, values), scores_of(token, keys, values))
    assert block.granularity == "block" and token.granularity == "token"
    assert prefill_keep(block, keys, values).shape[-1] == 16 + 40 % B
    assert prefill_keep(token, keys, values).shape[-1] == 16


def test_knorm_at_block_granularity_drops_the_block_with_the_largest_keys():
    key_norm = torch.tensor([1.0, 1.0, 5.0, 2.0, 1.0]).repeat_interleave(B)
    keys, values = with_norms(key_norm, torch.ones(20))
    assert decode_evict_block(make_policy("knorm_block", budget=16, block_size=B), keys, values) == 2


def probed_min_budget(name: str, options: dict, block_size: int) -> int | None:
    """The smallest whole-block budget at which the policy builds, found the old way: by trying."""
    for blocks in range(2, 65):
        try:
            make_policy(name, blocks * block_size, block_size, **options)
            return blocks * block_size
        except ValueError:
            continue
    return None


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name, options", MATRIX + [
    ("snapkv", {"window": 40}), ("snapkv", {"window": 64, "granularity": "block"}), ("h2o", {"recent": 70}),
    ("streaming", {"n_sink": 40}), ("snapkv", {"window": 33, "granularity": "block"}),
    ("hybrid", {"weights": {"snapkv": 1.0, "keydiff": 1.0}, "granularity": "block"})],
    ids=MATRIX_IDS + ["snapkv-w40", "snapkv-w64-block", "h2o-recent70", "streaming-sink40", "snapkv-w33-block", "hybrid-block"])
def test_a_policys_min_budget_is_the_smallest_budget_it_accepts(name, options, block_size):
    """``Policy.min_budget`` declares what probing with exceptions found: the least whole-block
    budget the policy builds at with these options (checked against trying each budget)."""
    probed = probed_min_budget(name, options, block_size)
    declared = make_policy(name, 64 * block_size, block_size, **options).min_budget()
    assert declared == probed


# --- the protected prefix (``protect_prefix``, a request's setting the policy carries) -------------------

PROTECTED = 13  # at B = 4: three whole blocks and one token of a fourth


def protecting(name: str, options: dict, budget: int, prefix: int = PROTECTED, block_size: int = B):
    """The policy these settings build, as the engine builds it (``build_policy``: the prefix set and
    checked against the budget)."""
    from harness.eviction.settings import EvictionSettings, build_policy

    return build_policy(EvictionSettings(name, budget, dict(options), protect_prefix=prefix), block_size)


def random_scores(policy, tokens: int, seed: int) -> torch.Tensor | None:
    if not policy.needs_kv:
        return None
    return torch.rand(LAYERS, HEADS, tokens, generator=torch.Generator().manual_seed(seed))


def decisions(policy, tokens: int, phase: str, seed: int):
    """The policy's decision on random scores: the kept ``[layers, heads, kept]`` or the victim block."""
    scores = random_scores(policy, tokens, seed)
    if phase == "prefill":
        return policy.select_prefill(scores, tokens, LAYERS, HEADS)
    if policy.granularity == "block":
        return policy.select_victim(scores, tokens)
    return policy.select_decode(scores, tokens, LAYERS, HEADS)


def drops_protected(decision, prefix: int) -> bool:
    if isinstance(decision, int):  # the victim block
        return decision * B < prefix
    return not (decision[..., :prefix] == torch.arange(prefix)).all()


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("name, options", MATRIX + [("kvzip", {})], ids=MATRIX_IDS + ["kvzip"])
def test_no_policy_evicts_a_protected_token(name, options, phase):
    """Every registered policy, at both granularities (and KVzip, whose scores its passes leave), keeps
    the first ``protect_prefix`` slots at every prefill and decode eviction, and a block policy never
    drops a block holding one; without the prefix the same scores drop some of them (the test bites).
    They count inside the budget: the keep sets are as large as without the prefix."""
    budget, tokens = 64, {"prefill": 100, "decode": 64 + B}[phase]
    bare, kept = protecting(name, options, budget, prefix=0), protecting(name, options, budget)
    bitten = False
    for seed in range(20):
        decision = decisions(kept, tokens, phase, seed)
        assert not drops_protected(decision, PROTECTED), (seed, decision)
        plain = decisions(bare, tokens, phase, seed)
        bitten |= drops_protected(plain, PROTECTED)
        if not isinstance(decision, int):
            assert decision.shape == plain.shape and (decision.diff(dim=-1) > 0).all()
    assert bitten, "without the prefix the same decisions drop a protected token"


def test_a_block_policy_drops_the_best_block_after_the_protected_ones():
    """PagedEviction's lowest block is block 1; with 5 tokens protected (blocks 0 and 1 hold them)
    the next lowest leaves, and with the ``local`` candidates the window of oldest blocks starts after them."""
    value_norm = torch.tensor([5.0, 1.0, 2.0, 3.0, 4.0, 5.0]).repeat_interleave(B)
    keys, values = with_norms(torch.ones(6 * B), value_norm)
    assert decode_evict_block(protecting("paged", {}, 20, prefix=0), keys, values) == 1
    assert decode_evict_block(protecting("paged", {}, 20, prefix=5), keys, values) == 2
    local = protecting("paged", {"candidates": "local", "local_blocks": 1}, 20, prefix=9)  # blocks 0-2 held
    assert decode_evict_block(local, keys, values) == 3


def test_streaming_keeps_the_protected_prefix_as_its_sinks():
    kept = decisions(protecting("streaming", {}, 32, prefix=10), 50, "prefill", 0)[0, 0].tolist()
    assert kept == list(range(10)) + list(range(28, 50))


@pytest.mark.parametrize("name, budget, message", [
    ("paged", 16, "protect_prefix=13 leaves 0 of budget=16 tokens beside the 4 block(s) holding it; paged needs 4 "
                  "there (at least a block, and the newest tokens its rule keeps): raise the budget to 20"),
    ("knorm", 16, "protect_prefix=13 leaves 3 of budget=16 tokens beside it; knorm needs 4 there"),
    ("h2o", 24, "protect_prefix=13 leaves 11 of budget=24 tokens beside it; h2o needs 12 there"),
    ("snapkv_block", 44, "snapkv_block needs 32 there"),  # the 8 blocks holding its window of 32
])
def test_a_prefix_that_leaves_the_rule_no_room_is_refused_in_one_line(name, budget, message):
    with pytest.raises(BudgetError) as error:
        protecting(name, {}, budget)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("prefix", [1, 13, 40])
@pytest.mark.parametrize("name, options", MATRIX, ids=MATRIX_IDS)
def test_min_budget_with_a_protected_prefix_is_the_smallest_budget_admitted(name, options, prefix):
    """What a ratio's budget on a short prompt, or a layer group's share, is raised to fits the prefix."""
    admitted = []
    for blocks in range(2, 65):
        try:
            protecting(name, options, blocks * B, prefix)
            admitted.append(blocks * B)
        except ValueError:
            continue
    assert admitted and protecting(name, options, 64 * B, prefix).min_budget() == admitted[0]
    assert admitted == list(range(admitted[0], 65 * B, B)), "every larger budget too"

"""Layer groups in the Hugging Face reference (``harness.eviction.hf_reference``): one policy per
group of consecutive layers (the engine's ``engine.layer_groups``), each group's layers evicting at
their own lengths by their own budget, with their own policy state and query window, and each layer
attending under its own causal mask. Checked two ways: a per-head rule in G groups at one budget
equals one group bit for bit (outputs and every layer's cache; one group keeps Hugging Face's own
mask); and groups at different budgets equal the plain reference (``tests/support/plain_reference.py``,
no shared code) token for token, with every layer holding what the plain reference's does."""
from __future__ import annotations

import pytest
import torch

from harness.eviction.hf_reference import HFReferenceEngine, own_causal_mask
from policies import make_policy
from tests.support.engine_support import model_path, plain_policy, text_prompts
from tests.support.plain_reference import PlainReference

BLOCK = 8  # small blocks: a 100-token prompt and a few new tokens reach both phases in every group
PROMPT = 100
NEW = 24
PER_HEAD = ["knorm", "snapkv", "h2o"]  # choose per layer and KV head: the groups cannot change a choice


@pytest.fixture(scope="module")
def prompt():
    return text_prompts("tiny", [PROMPT], seed=5)[0]


def cache_of(engine: HFReferenceEngine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in engine.cache.layers]


def cases(names, sizes, fast, ids=None) -> list:
    """Every (name, size) case; the fast loop (``-m "not engine and not slow"``) keeps ``fast``
    alone, each case being two Hugging Face generations of several seconds (CI runs them all)."""
    return [pytest.param(name, size, id=f"{name}-{ids[i] if ids else size}",
                         marks=() if (name, size) == fast else pytest.mark.slow)
            for name in names for i, size in enumerate(sizes)]


@pytest.mark.parametrize("name, groups", cases(PER_HEAD, [2, 4], fast=("snapkv", 2)))
def test_groups_of_a_per_head_policy_equal_one_group(prompt, name, groups):
    """SnapKV from each group's own layers' window, H2O counting every query in every group."""
    one = HFReferenceEngine(model_path("tiny"), make_policy(name, 48, BLOCK))
    expected = one.generate(prompt, NEW)
    cache = cache_of(one)
    grouped = HFReferenceEngine(model_path("tiny"), [make_policy(name, 48, BLOCK) for _ in range(groups)])
    assert grouped.generate(prompt, NEW) == expected
    assert cache[0][0].shape[2] < PROMPT, "the cache was evicted"
    for (keys, values), layer in zip(cache, grouped.cache.layers):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@pytest.mark.parametrize("name, budgets", cases(["paged", "knorm", "snapkv", "h2o"], [[72, 40], [64, 48, 40, 40]],
                                                fast=("paged", [72, 40]), ids=["2_groups", "4_groups"]))
def test_groups_at_their_own_budgets_equal_the_plain_reference(prompt, name, budgets):
    """Each group's layers keep what their own budget says (the layers then hold different numbers
    of tokens, so each attends under its own mask), as the plain reference evicts them."""
    plain = PlainReference(model_path("tiny"))
    expected, counts = plain.generate(prompt, NEW, [plain_policy(name, budget, BLOCK) for budget in budgets])
    engine = HFReferenceEngine(model_path("tiny"), [make_policy(name, budget, BLOCK) for budget in budgets])
    assert engine.generate(prompt, NEW) == expected
    lengths = [layer.keys.shape[2] for layer in engine.cache.layers]
    assert lengths == counts["lengths"]
    span = len(lengths) // len(budgets)
    assert len(set(lengths[::span])) > 1, f"the groups hold different numbers of tokens: {lengths}"


def test_own_mask_is_the_causal_mask_over_what_a_layer_holds():
    query, key = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4)
    mask = own_causal_mask(query, key, torch.float32)
    allowed = (mask == 0)[0, 0]
    # three new tokens, the last two keys of five theirs: the first new token sees keys 0-2
    assert allowed.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]


def test_groups_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="divide"):
        HFReferenceEngine(model_path("tiny"), [make_policy("paged", 64, BLOCK) for _ in range(3)])
    with pytest.raises(ValueError, match="query window"):
        HFReferenceEngine(model_path("tiny"), [make_policy("paged", 64, BLOCK), make_policy("snapkv", 64, BLOCK)])


@pytest.mark.slow  # SmolLM2 (135M) loaded three times a case: the reference, its attention weights, the plain reference
@pytest.mark.parametrize("name", ["paged", "snapkv"])
def test_the_attention_schedule_measures_what_the_models_attention_weights_say(name):
    """CAKE's preference of each layer from Hugging Face's own attention weights over the prompt
    (``output_attentions``; the last 32 queries, the keys before them), computed here on its own: the
    reference's measured budgets are the schedule's budgets for those preferences, and the plain
    reference evicting each group by them generates what the reference generates. SmolLM2 (30
    layers as 3 groups): the tiny model's random weights attend almost evenly, so its layers'
    preferences barely differ."""
    from transformers import AutoModelForCausalLM

    from harness.eviction.settings import group_policies, least_blocks, parse_settings
    from policies.budget_schedules import group_budgets

    prompt = text_prompts("smollm2", [PROMPT], seed=5)[0]
    settings = parse_settings({"policy": name, "budget": 48, "budget_schedule": "attention"}, "test")
    engine = HFReferenceEngine(model_path("smollm2"), list(group_policies(settings, BLOCK, 30, 3)), schedule=settings)
    ids = engine.generate(prompt, NEW)
    model = AutoModelForCausalLM.from_pretrained(model_path("smollm2"), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        attentions = model(torch.tensor([prompt]), output_attentions=True).attentions  # per layer [1, heads, q, k]
    preferences = []
    for weights in attentions:
        rows = weights[0, :, -32:, : len(prompt) - 32].double()  # heads x window x the keys before it
        entropy = -(rows * torch.log(rows)).sum()  # softmax rows: no zeros before the window
        preferences.append(float(entropy * rows.var(dim=1, unbiased=True).sum()))
    expected = group_budgets("attention", 48, 30, 3, BLOCK, preferences=preferences,
                             min_blocks=least_blocks(settings, BLOCK))
    assert engine.measured_budgets == expected and len(set(expected)) > 1, (engine.measured_budgets, expected)
    plain = PlainReference(model_path("smollm2"))
    assert plain.generate(prompt, NEW, [plain_policy(name, budget, BLOCK) for budget in expected])[0] == ids

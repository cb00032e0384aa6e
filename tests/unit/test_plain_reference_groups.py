"""Layer groups in the plain reference (tests/support/plain_reference.py): one rule per group of
contiguous layers, each group evicting on its own layers at its own length, so layers hold different
numbers of tokens. Checked three ways: groups that must choose alike equal one group bit for bit;
each group's evictions fall when its own budget says; and a slow recomputation from scratch, with an
explicit per-layer kept-token list, reproduces the output, the kept tokens and their K."""
from __future__ import annotations

import pytest
import torch

from tests.support.engine_support import model_path, plain_policy, text_prompts
from tests.support.plain_reference import PlainPolicy, PlainReference

BLOCK = 8  # small blocks: a 100-token prompt and a few new tokens reach both phases in every group
PROMPT = 100
NEW = 24


@pytest.fixture(scope="module")
def plain():
    return PlainReference(model_path("tiny"))


@pytest.fixture(scope="module")
def prompt():
    return text_prompts("tiny", [PROMPT], seed=5)[0]


def knorm(budget: int, decode_eviction: bool = True) -> PlainPolicy:
    return PlainPolicy("knorm", "token", budget, BLOCK, per_head=True, decode_eviction=decode_eviction)


@pytest.mark.parametrize("context", [None, 60], ids=["decode", "context"])
@pytest.mark.parametrize("groups", [2, 4])
def test_groups_of_one_per_head_rule_equal_one_group(plain, prompt, groups, context):
    """A per-head rule chooses per layer and head anyway: G groups at one budget keep what one group
    keeps, and compute it bit for bit, though with groups every layer builds its own mask (one group
    keeps Hugging Face's). With a context, the question runs as one chunk after the eviction."""
    ids, counts = plain.generate(prompt, NEW, knorm(48, context is None), context)
    cache, positions = plain.cache, plain.positions
    assert counts["prefill"] == 1 and (context or counts["decode"] >= 1), counts
    grouped_ids, grouped = plain.generate(prompt, NEW, [knorm(48, context is None) for _ in range(groups)], context)
    assert grouped_ids == ids
    for key in ("prefill", "decode", "lengths"):
        assert grouped[key] == counts[key], key
    assert grouped["groups"] == counts["groups"] * groups
    for layer in range(len(cache.layers)):
        assert torch.equal(plain.positions[layer], positions[layer])
        assert torch.equal(plain.cache.layers[layer].keys, cache.layers[layer].keys)
        assert torch.equal(plain.cache.layers[layer].values, cache.layers[layer].values)


def block_rule_lengths(budget: int, prompt: int, new_tokens: int) -> tuple[int, list[int], int]:
    """Block granularity by its rule alone: prefill evictions, the logical lengths decode evictions
    follow, the final length. The prefill eviction keeps C + L mod B; a decode step that brings the
    cache to C + B or more and a whole number of blocks drops one block."""
    length = budget + prompt % BLOCK if prompt > budget else prompt
    decode_at = []
    for logical in range(prompt + 1, prompt + new_tokens):  # the first new token came from the prefill
        length += 1
        if length >= budget + BLOCK and length % BLOCK == 0:
            length -= BLOCK
            decode_at.append(logical)
    return int(prompt > budget), decode_at, length


@pytest.mark.parametrize("budgets", [[60, 34], [62, 52, 42, 32]], ids=["2_groups", "4_groups"])
def test_each_group_evicts_at_its_own_budget(plain, prompt, budgets):
    """PagedEviction's rule, one budget per group (budgets apart modulo the block, so the groups'
    decode evictions fall at different steps): each group evicts when its own length says, its
    layers end at its own length, and its one keep set (the rule's, per request) spans its layers only."""
    ids, counts = plain.generate(prompt, NEW, [plain_policy("paged", budget, BLOCK) for budget in budgets])
    span = len(counts["lengths"]) // len(budgets)
    expected = [block_rule_lengths(budget, PROMPT, NEW) for budget in budgets]
    assert len(ids) == NEW
    for g, (prefill, decode_at, length) in enumerate(expected):
        assert decode_at, "every group evicts in decode"
        assert counts["groups"][g] == {"prefill": prefill, "decode": len(decode_at), "decode_at": decode_at}
        assert counts["lengths"][g * span:(g + 1) * span] == [length] * span
        held = plain.positions[g * span]
        assert held.shape[-1] == length and (held == held[:1]).all(), "one keep set for the group's heads"
        assert all(torch.equal(plain.positions[layer], held) for layer in range(g * span, (g + 1) * span))
        assert held[0, :BLOCK].tolist() == list(range(BLOCK)), "the first block always stays"
        assert held[0, -1] == PROMPT + NEW - 2, "the newest token (the last output is never fed) stays"
    assert len({tuple(decode_at) for _, decode_at, _ in expected}) == len(budgets), "own times, not shared"
    assert counts["decode"] == len({step for _, decode_at, _ in expected for step in decode_at})


class SlowReference:
    """Greedy generation with evictions, recomputed from scratch for every pass: the whole sequence
    goes through the model with no cache carried over, each layer's attention masked by an explicit
    record of what each token read at that layer (and KV head) when it was computed: the tokens the
    layer held then, and its own chunk causally. Positions are plain ``arange``, i.e. logical. The
    group's rule is applied to the K/V of the tokens each of its layers holds."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        self.masks: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.model.model.layers):
            layer.self_attn.register_forward_pre_hook(self._mask(index), with_kwargs=True)

    def _mask(self, index: int):
        def replace(module, args, kwargs):
            return args, {**kwargs, "attention_mask": self.masks[index]}
        return replace

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int, rules: list[PlainPolicy], context_tokens: int | None):
        from transformers import DynamicCache

        config = self.model.config
        layers, heads = config.num_hidden_layers, config.num_key_value_heads
        readers = config.num_attention_heads // heads  # query heads per KV head
        span = layers // len(rules)
        evict_at = context_tokens or len(prompt)
        tokens, out = list(prompt[:evict_at]), []
        sees = [torch.zeros(heads, 0, 0, dtype=torch.bool) for _ in range(layers)]  # [head, token, token read]
        held = [[[] for _ in range(heads)] for _ in range(layers)]  # logical positions, in cache order
        while len(out) < new_tokens:
            done, total = sees[0].shape[-1], len(tokens)
            for layer in range(layers):
                grown = torch.zeros(heads, total, total, dtype=torch.bool)
                grown[:, :done, :done] = sees[layer]
                grown[:, done:, done:] = torch.ones(total - done, total - done, dtype=torch.bool).tril()
                for head in range(heads):
                    grown[head, done:, held[layer][head]] = True
                    held[layer][head] += range(done, total)
                sees[layer] = grown
                hidden = ~grown.repeat_interleave(readers, dim=0)[None]
                self.masks[layer] = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
            cache = DynamicCache(config=config)
            logits = self.model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits
            for g, rule in enumerate(rules):
                members = range(g * span, (g + 1) * span)
                keys = [torch.stack([cache.layers[l].keys[0, h, held[l][h]] for h in range(heads)])
                        for l in members]
                values = [torch.stack([cache.layers[l].values[0, h, held[l][h]] for h in range(heads)])
                          for l in members]
                length = keys[0].shape[1]
                if total == evict_at and length > rule.budget:
                    kept = rule.keep(keys, values, "prefill")
                elif (total != evict_at and rule.decode_eviction and length >= rule.budget + rule.block
                      and length % rule.block == 0):
                    kept = rule.keep(keys, values, "decode")
                else:
                    continue
                if isinstance(kept, int):  # the block leaves
                    kept = torch.tensor([i for i in range(length) if i // rule.block != kept]).expand(span, heads, -1)
                for l, layer_kept in zip(members, kept):
                    held[l] = [[held[l][h][i] for i in layer_kept[h].tolist()] for h in range(heads)]
            if total < len(prompt):  # the question after the compressed context
                tokens = list(prompt)
                continue
            out.append(int(logits[0, -1].argmax()))
            tokens.append(out[-1])
        held_keys = [torch.stack([cache.layers[l].keys[0, h, held[l][h]] for h in range(heads)]) for l in range(layers)]
        return out, held, held_keys


@pytest.fixture(scope="module")
def slow():
    return SlowReference(model_path("tiny"))


CASES = {  # rules per group (a function of whether decode evicts), context tokens, new tokens
    "paged_2_groups": (lambda: [plain_policy("paged", budget, BLOCK) for budget in (60, 34)], None, 12),
    "knorm_4_groups": (lambda: [knorm(budget) for budget in (62, 52, 42, 32)], None, 12),
    "knorm_context_2_groups": (lambda: [knorm(budget, False) for budget in (56, 36)], 72, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_groups_equal_a_recomputation_from_scratch(plain, slow, prompt, case):
    """Layers holding different tokens, in decode and in a multi-token chunk after an eviction (the
    question after a compressed context): the same output, the same tokens held per layer and head,
    and the same K for them (to float32 noise: the recomputation runs other shapes), so each layer
    attended to what it held and no more, at logical positions."""
    rules, context, new_tokens = CASES[case]
    ids, counts = plain.generate(prompt, new_tokens, rules(), context)
    lengths = counts["lengths"]
    assert len(set(lengths)) > 1, f"the layers must hold different numbers of tokens: {lengths}"
    want_ids, held, held_keys = slow.generate(prompt, new_tokens, rules(), context)
    assert ids == want_ids
    for layer, (positions, keys) in enumerate(zip(held, held_keys)):
        assert plain.positions[layer].tolist() == positions, f"layer {layer}"
        torch.testing.assert_close(plain.cache.layers[layer].keys[0], keys, rtol=1e-4, atol=1e-4)


def test_groups_refuse_what_they_cannot_do(plain, prompt):
    with pytest.raises(ValueError, match="divide"):
        plain.generate(prompt, 2, [knorm(48)] * 3)
    shared = PlainPolicy("h2o", "token", 48, BLOCK)
    with pytest.raises(ValueError, match="its own rule object"):
        plain.generate(prompt, 2, [shared, shared])
    with pytest.raises(ValueError, match="decode_eviction"):
        plain.generate(prompt, 2, [knorm(48, False), knorm(48)], context_tokens=60)


@pytest.mark.parametrize("score", ["snapkv", "h2o"])
def test_groups_of_a_rule_reading_queries_equal_one_group(plain, prompt, score):
    """SnapKV reads each layer's own window of queries, H2O sums what each layer's queries paid:
    per layer and head, so groups (each its own rule object) keep what one group keeps."""
    ids, counts = plain.generate(prompt, NEW, PlainPolicy(score, "token", 48, BLOCK))
    grouped_ids, grouped = plain.generate(prompt, NEW, [PlainPolicy(score, "token", 48, BLOCK) for _ in range(2)])
    assert counts["prefill"] == 1 and counts["decode"] >= 1
    assert grouped_ids == ids and grouped["lengths"] == counts["lengths"]

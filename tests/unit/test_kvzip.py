"""KVzip without a model: its score against a hand computation (the plain reference's rule and the
policy's), the policy's tiled, pieced score against the plain rule, the passes a context splits
into, the evictor's keep sets against the plain rule's, and the refusals of settings it cannot run."""
from __future__ import annotations

import math

import pytest
import torch

from harness.eviction.evictor import MissingReconstructionError, evict
from harness.eviction.settings import EvictionSettings, admit, parse_settings
from harness.eviction.state import PolicyState
from harness.engine.backend_views import FlashAttnView
from policies import REGISTRY, make_policy
from policies.kvzip import chunk_scores, passes, with_sinks
from tests.support.plain_reference import PlainPolicy, Repeat, kvzip_chunk_scores
from tests.support.policy_matrix import MATRIX
from tests.support.policy_probe import assert_pool_holds

RECONSTRUCTION = {"prefix_tokens": 6, "first": [11, 12, 13], "later": [21, 22], "suffix": [31]}


def hand_case():
    """One layer, 2 KV heads, 4 query heads (2 per KV head), head_dim 1, scale 1: a context of 3
    tokens whose chunk is [1, 3) (one sink column: min(4, 1)), and a pass of 2 tokens with queries
    1 (KV head 0's query heads read logits equal to the keys) or 0 (KV head 1's: uniform)."""
    ln2, ln3 = math.log(2.0), math.log(3.0)
    # keys [kv heads, context + pass, 1]: KV head 0: k0=0, k1=ln2, k2=0, own o0=0, o1=ln3; KV head 1: anything
    keys = torch.tensor([[0.0, ln2, 0.0, 0.0, ln3], [5.0, -1.0, 2.0, 0.5, 0.25]])[..., None]
    queries = torch.zeros(2, 4, 1)  # [pass tokens, query heads, dim]
    queries[:, 0] = 1.0   # query head 0 (KV head 0): logits = keys
    queries[0, 1] = 1.0   # query head 1 (KV head 0): token 0 as head 0, token 1 reads all-zero logits
    # query heads 2, 3 (KV head 1): zero queries, so every visible key gets the same attention
    return queries, keys


# By hand. KV head 0, query head 0, pass token 0 sees [k0, k1, k2, o0] (o1 is later): exp = [1, 2, 1, 1],
# sum 5, so k1 = 2/5, k2 = 1/5; token 1 sees all five: [1, 2, 1, 1, 3], sum 8: k1 = 2/8, k2 = 1/8.
# Query head 1's token 1 is uniform over 5: 1/5 each. Max over queries and query heads: k1 = 2/5,
# k2 = 1/5. KV head 1: uniform, token 0 over 4 keys (1/4), token 1 over 5 (1/5): max 1/4 each.
HAND = torch.tensor([[2 / 5, 1 / 5], [1 / 4, 1 / 4]])


def test_the_plain_rule_equals_a_hand_computation():
    queries, keys = hand_case()
    torch.testing.assert_close(kvzip_chunk_scores(queries, keys, 1, 3, 1.0), HAND)


def test_the_policy_score_equals_a_hand_computation():
    queries, keys = hand_case()
    as_cached = keys.permute(1, 0, 2)  # [tokens, kv heads, dim], the harness's layout
    got = chunk_scores(queries, as_cached[:1], as_cached[1:3], as_cached[3:], 1.0)
    torch.testing.assert_close(got, HAND)


@pytest.mark.parametrize("start", [0, 2, 9])
def test_the_policy_score_in_tiles_and_pieces_equals_the_plain_rule(start):
    """Random post-RoPE queries and keys (3 KV heads, 9 query heads, head_dim 16): a pass of 37
    tokens over a context of 40 whose chunk starts at ``start`` (0: no sink column). The policy's
    score with tiles of 5 queries, the pass given in pieces of 10 queries (each with every earlier own
    key), folded by maximum, equals the plain rule's over the whole pass."""
    gen = torch.Generator().manual_seed(start)
    context, r, kv_heads, query_heads, dim, scale = 40, 37, 3, 9, 16, 0.25
    keys = torch.randn(kv_heads, context + r, dim, generator=gen)
    queries = torch.randn(r, query_heads, dim, generator=gen)
    end = 33
    want = kvzip_chunk_scores(queries, keys, start, end, scale)
    cached = keys.permute(1, 0, 2)
    sinks = cached[: min(4, start)]
    got = torch.zeros_like(want)
    for piece in range(0, r, 10):
        last = min(piece + 10, r)
        own = cached[context : context + last]
        got = torch.maximum(got, chunk_scores(queries[piece:last], sinks, cached[start:end], own, scale, tile=5))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [3, 5, 16, 2048])
def test_passes_equal_the_plain_reference(chunk):
    """The passes' ids and chunks (the first chunk after ``first``, later ones after ``later`` and
    the previous chunk's last 8 ids, all of it when the chunk is shorter, then the footer)."""
    context = list(range(100, 130))
    spec = RECONSTRUCTION
    mine = passes(context, spec["prefix_tokens"], spec["first"], spec["later"], spec["suffix"], chunk, 8)
    plain = Repeat(spec["prefix_tokens"], spec["first"], spec["later"], spec["suffix"], chunk).passes(context)
    assert mine == plain
    assert [(start, end) for _, start, end in mine][0] == (6, min(6 + chunk, 30)) and mine[-1][2] == 30
    if chunk == 16:
        assert mine[1][0] == [21, 22] + context[14:22] + [31] + context[22:30]


def test_sinks_outrank_every_other_score():
    scores = torch.rand(2, 3, 20)
    top = float(scores.max())
    with_sinks(scores, 4)
    assert (scores[..., :4] == top + 1).all() and (scores[..., 4:] <= top).all()


@pytest.mark.parametrize("whole_blocks", [False, True], ids=["prompt", "context"])
@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("block", [32, 16])
def test_the_evictor_keeps_what_the_plain_rule_keeps(granularity, block, whole_blocks):
    """Random K/V of 3 layers x 2 KV heads and random reconstruction scores (sinks on top): the
    harness's evictor, reading the scores from the request's state, leaves exactly the K/V the
    plain rule keeps from the same scores: per KV head, the 4 sinks and the best others (token), or
    PagedEviction's first block, last ``B + L mod B`` tokens and best middle, per KV head (block);
    with ``whole_blocks`` (``compress=context``, set by ``build_policy``) a block rule's last ``B``
    tokens, the budget exactly (200 tokens: 200 mod B is 8 at 32 and 16, so the two rules differ)."""
    budget, layers, heads, dim, tokens = 96, 3, 2, 8, 200
    gen = torch.Generator().manual_seed(block)
    view = FlashAttnView([torch.randn(16, heads, block, 2 * dim, generator=gen) for _ in range(layers)])
    blocks = list(range(-(-tokens // block)))
    keys = [view.read_layer(l, blocks, 0, tokens)[0].permute(1, 0, 2) for l in range(layers)]
    values = [view.read_layer(l, blocks, 0, tokens)[1].permute(1, 0, 2) for l in range(layers)]
    scores = with_sinks(torch.rand(layers, heads, tokens, generator=gen), 4)
    policy = make_policy("kvzip", budget, block, granularity=granularity)
    policy.whole_blocks = whole_blocks  # a run setting (build_policy's for compress=context)
    state = PolicyState(scales=[0.3] * layers)
    state.scores["r"] = scores.clone()
    eviction = evict(policy, view, blocks, tokens, "prefill", state, "r")
    assert "r" not in state.scores  # read once: KVzip compresses once

    rule = PlainPolicy("kvzip", granularity, budget, block, decode_eviction=False)
    rule.reconstructed = scores
    kept = rule.keep(keys, values, "prefill", whole_blocks=whole_blocks)
    assert kept.shape[-1] == (budget if granularity == "token" or whole_blocks else budget + tokens % block)
    assert_pool_holds(view, blocks, eviction.kept_blocks, kept, keys, values)
    assert (kept[..., :4] == torch.arange(4)).all()  # the sinks stayed in every layer and head
    assert not (kept[0, 0] == kept[0, 1]).all()  # heads chose apart


def test_an_eviction_without_reconstruction_fails_its_request():
    view = FlashAttnView([torch.randn(4, 2, 32, 16)])
    policy = make_policy("kvzip", 64, 32)
    with pytest.raises(Exception, match="reconstruction passes, but none ran"):
        evict(policy, view, [0, 1, 2], 90, "prefill", PolicyState(scales=[0.3]), "r")
    assert issubclass(MissingReconstructionError, RuntimeError)


def context_settings(**changes) -> dict:
    raw = {"policy": "kvzip", "budget": 64, "decode_eviction": False, "compress": "context", "context_tokens": 100,
           "reconstruction": dict(RECONSTRUCTION)}
    raw.update(changes)
    return raw


def admitted(raw: dict, prompt: int = 140):
    settings = parse_settings(raw, "request").for_prompt(prompt, 32)
    return admit(settings, 32, 30, 1, enforce_eager=True, async_scheduling=False)


def test_settings_carry_the_reconstruction_on_the_wire():
    settings = parse_settings(context_settings(), "request")
    assert settings.reconstruction.first == (11, 12, 13) and settings.reconstruction.prefix_tokens == 6
    assert parse_settings(settings.as_dict(), "again") == settings
    assert EvictionSettings(**context_settings()) == settings  # a mapping becomes the record
    assert settings.key == parse_settings(context_settings(reconstruction={**RECONSTRUCTION, "first": [9]}), "r").key
    (policy,) = admitted(context_settings())
    assert policy.reconstructs and policy.score.token_edges(64, 32) == (4, 0)
    admitted(context_settings(compress="prompt", context_tokens=None))  # the whole prompt reconstructed


@pytest.mark.parametrize("changes, message", [
    ({"decode_eviction": True, "compress": "prompt", "context_tokens": None}, "pass decode_eviction=false"),
    ({"reconstruction": None}, "must give its reconstruction ids"),
    ({"reconstruction": {**RECONSTRUCTION, "prefix_tokens": 100}}, "leaves nothing"),
    ({"reconstruction": {**RECONSTRUCTION, "first": []}}, "cannot be empty"),
    ({"reconstruction": {**RECONSTRUCTION, "suffix": "x"}}, "list of token ids"),
    ({"chain": True}, "reconstructs the pristine context"),
    ({"options": {"n_sink": 64}}, "n_sink must be in"),
    ({"options": {"chunk_size": 0}}, "chunk_size must be"),
    ({"policy": "knorm"}, "knorm does not reconstruct"),
])
def test_settings_it_cannot_run_are_refused_with_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as refused:
        admitted(context_settings(**changes))
    assert "\n" not in str(refused.value)


def test_compiled_graphs_and_hybrids_are_refused():
    settings = parse_settings(context_settings(), "request").for_prompt(140, 32)
    with pytest.raises(ValueError, match="enforce_eager"):
        admit(settings, 32, 30, 1, enforce_eager=False, async_scheduling=False)
    with pytest.raises(ValueError, match="cannot combine 'kvzip'"):
        make_policy("hybrid", 64, 32, weights={"kvzip": 1.0})


def test_the_generic_matrix_leaves_reconstructing_policies_out():
    assert REGISTRY["kvzip"].reconstructs and not REGISTRY["kvzip"].reads_attention
    assert not [name for name, _ in MATRIX if REGISTRY[name].reconstructs]

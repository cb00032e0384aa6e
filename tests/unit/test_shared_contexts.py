"""The compressed-context cache's references on vLLM's own block pool (``harness.engine.shared_contexts``):
an entry pins its blocks while requests hold them, lets them go like the prefix cache once none does
(free, at the queue's tail, found again until the pool hands one out), and refuses a write into a
kept block. The share setting is checked with the other settings. The engine tests
(``tests/engine/test_context_compression.py`` and the tensor-parallel and layer-group ones) show
that requests taking an entry generate what they generate computing their own."""
from __future__ import annotations

from dataclasses import replace

import pytest
from vllm.v1.core.block_pool import BlockPool

from harness.engine.shared_contexts import ContextCache, chain_entry_key, context_key
from harness.eviction.settings import EvictionSettings, parse_settings

BLOCK = 4


def pool_and_cache(blocks: int = 10):
    pool = BlockPool(blocks, enable_caching=True, hash_block_size=BLOCK)
    return pool, ContextCache(pool)


def compressed(pool, count: int):
    """A request's kept blocks, as vLLM allocated them to it (one reference: the request's)."""
    return pool.get_new_blocks(count)


def test_an_entry_is_held_while_a_request_holds_it_and_free_but_found_once_none_does():
    pool, cache = pool_and_cache()
    free = pool.get_num_free_blocks()
    kept = compressed(pool, 3)
    assert cache.publish("ctx", "first", 10, (10,), (kept,))
    assert [block.ref_cnt for block in kept] == [2, 2, 2]  # the request's and the cache's
    cache.release_idle()
    assert "ctx" in cache.pinned, "the first request still holds its blocks"
    pool.free_blocks(kept)  # the request finishes
    cache.release_idle()
    assert "ctx" not in cache.pinned and pool.get_num_free_blocks() == free  # counted as free, like the prefix cache's
    entry = cache.take("ctx")  # a later request finds it and pins it again
    assert entry.blocks == (tuple(kept),) and [block.ref_cnt for block in kept] == [1, 1, 1]
    assert pool.get_num_free_blocks() == free - 3


def test_the_pool_reclaims_idle_entries_last_and_then_the_entry_is_gone():
    pool, cache = pool_and_cache(blocks=8)  # 7 usable
    kept = compressed(pool, 2)
    cache.publish("ctx", "first", 9, (8,), (kept,))
    pool.free_blocks(kept)
    cache.release_idle()
    others = pool.get_new_blocks(5)  # the blocks nobody can find go first
    assert "ctx" in cache.entries and not {b.block_id for b in others} & {b.block_id for b in kept}
    pool.get_new_blocks(1)  # then the least recently released: the entry's
    assert "ctx" not in cache.entries and cache.stats.reclaimed == 1
    assert cache.take("ctx") is None


def test_two_entries_sharing_a_block_are_let_go_together_and_each_dropped_when_it_is_reused():
    pool, cache = pool_and_cache()
    # a block both requests hold (a layer group within its budget keeps its pristine blocks)
    shared, own_a, own_b = compressed(pool, 1), compressed(pool, 1), compressed(pool, 1)
    pool.touch(shared)  # the second request's reference
    cache.publish("a", "ra", 8, (8,), (shared + own_a,))
    cache.publish("b", "rb", 8, (8,), (shared + own_b,))
    pool.free_blocks(shared + own_a)
    cache.release_idle()
    assert "a" in cache.pinned and "b" in cache.pinned  # the second request holds the shared block
    pool.free_blocks(shared + own_b)  # both requests gone
    cache.release_idle()
    assert "a" not in cache.pinned and "b" not in cache.pinned
    assert pool.get_num_free_blocks() == 9
    pool.get_new_blocks(9)
    assert not cache.entries and cache.stats.reclaimed == 2


def test_a_reset_drops_every_entry_and_finds_every_block_free():
    pool, cache = pool_and_cache()
    kept = compressed(pool, 2)
    cache.publish("ctx", "first", 8, (8,), (kept,))
    pool.free_blocks(kept)
    cache.clear()
    assert pool.reset_prefix_cache() and not cache.entries


def test_only_the_compressing_request_writes_on_past_its_partial_last_kept_block():
    pool, cache = pool_and_cache()
    kept = compressed(pool, 2)
    cache.publish("ctx", "first", 9, (6,), (kept,))  # 6 tokens: a full block and half of one
    cache.check_writes("first", 0, kept, 1, 1, BLOCK)  # its question, after the kept half
    with pytest.raises(RuntimeError, match="shared compressed context"):
        cache.check_writes("first", 0, kept, 0, 1, BLOCK)
    with pytest.raises(RuntimeError, match="shared compressed context"):
        cache.check_writes("later", 0, kept, 1, 1, BLOCK)
    cache.check_writes("later", 0, kept + compressed(pool, 1), 2, 2, BLOCK)  # its own block


def test_a_context_key_is_its_last_whole_blocks_hash_its_tail_tokens_and_the_settings():
    class Request:
        def __init__(self, tokens):
            self.all_token_ids = tokens
            self.block_hashes = [hash(tuple(tokens[: end])) for end in range(BLOCK, len(tokens) + 1, BLOCK)]

    settings = EvictionSettings("paged", 8, compress="context", context_tokens=6, decode_eviction=False)
    one, two = Request([1, 2, 3, 4, 5, 6, 7, 8, 9]), Request([1, 2, 3, 4, 5, 6, 9, 9, 9])
    assert context_key(one, settings, BLOCK) == context_key(two, settings, BLOCK)  # the question is not in it
    assert context_key(Request([1, 2, 3, 4, 5, 0, 7, 8]), settings, BLOCK) != context_key(one, settings, BLOCK)
    assert context_key(one, settings.__class__(**{**settings.__dict__, "budget": 12}), BLOCK) != \
        context_key(one, settings, BLOCK)
    assert context_key(one, settings.__class__(**{**settings.__dict__, "context_tokens": 3}), BLOCK) is None


CONTEXT = {"policy": "paged", "budget": 64, "decode_eviction": False, "compress": "context"}


@pytest.mark.parametrize("raw, error", [
    ({**CONTEXT, "share_context": "yes"}, "share_context must be true, false or null"),
    ({"policy": "paged", "budget": 64, "share_context": True}, "compress=prompt keeps what the question attends to"),
    ({**CONTEXT, "budget_schedule": "attention", "share_context": True}, "measures each request's layer budgets"),
])
def test_a_share_setting_that_cannot_hold_is_refused_with_its_reason(raw, error):
    with pytest.raises(ValueError, match=error):
        parse_settings(raw, "request kv_eviction")


def test_the_share_setting_travels_and_names_a_cell_only_when_set():
    off = parse_settings({**CONTEXT, "share_context": False}, "request")
    assert off.share_context is False and parse_settings(off.as_dict(), "again") == off
    assert parse_settings(CONTEXT, "request").share_context is None
    assert "share_context" not in parse_settings(CONTEXT, "request").identity()
    assert off.identity()["share_context"] is False


# --- chain=true: a finished turn's whole kept cache, for the next turn ----------------------------

class Turn:
    """A request's token ids and vLLM's chained hashes of its whole blocks (``hash`` of the prefix:
    chained like vLLM's, kv_cache_utils.py:695-725)."""

    def __init__(self, tokens):
        self.all_token_ids = list(tokens)
        self.block_hashes = [hash(tuple(tokens[: end])) for end in range(BLOCK, len(tokens) + 1, BLOCK)]


CHAIN = EvictionSettings("paged", None, budget_ratio=0.5, compress="context", context_tokens=9,
                         decode_eviction=False, chain=True)


def test_a_chain_entry_is_found_by_the_next_turn_whose_prompt_begins_with_its_tokens():
    pool, cache = pool_and_cache()
    first = Turn([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # a turn's prompt and answer: 10 computed, 11 the last output
    key = chain_entry_key(first, CHAIN.for_prompt(9, BLOCK), 10, BLOCK)
    assert cache.publish(key, "turn1", 10, (6,), (compressed(pool, 2),))
    assert cache.stats.chain_published == 1 and cache.stats.published == 0
    # the next turn: the same tokens, a new message, its boundary after the answer; its ratio budget is
    # resolved against its own (longer) history, and the entry is still found
    later = Turn([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
    settings = CHAIN.at_context(11).for_prompt(15, BLOCK)
    assert cache.find_chain(later, settings, 11, BLOCK) == key
    assert cache.find_chain(later, settings, 10, BLOCK) is None, "a turn computes a token before its boundary"
    other = Turn([1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 11, 12, 13])  # differs inside the entry's partial block
    assert cache.find_chain(other, settings, 11, BLOCK) is None
    assert cache.find_chain(later, replace(settings, policy="knorm"), 11, BLOCK) is None
    assert cache.find_chain(later, replace(settings, chain=False), 11, BLOCK) is None


def test_the_longest_chain_entry_is_taken_and_a_held_entry_outlives_its_takers_preemption():
    pool, cache = pool_and_cache(blocks=12)
    tokens = list(range(1, 20))
    short, long_ = Turn(tokens[:7]), Turn(tokens[:13])
    settings = CHAIN.at_context(16)
    k1 = chain_entry_key(short, settings, 6, BLOCK)
    k2 = chain_entry_key(long_, settings, 12, BLOCK)
    b1, b2 = compressed(pool, 1), compressed(pool, 2)
    cache.publish(k1, "t1", 6, (3,), (b1,))
    cache.publish(k2, "t2", 12, (7,), (b2,))
    pool.free_blocks(b1 + b2)  # both turns finished
    taker = Turn(tokens)
    assert cache.find_chain(taker, settings, 16, BLOCK) == k2
    entry = cache.take(k2)
    cache.hold(k2, "t3")
    cache.release_idle()  # the taker was preempted: it holds no block, but it holds the entry
    assert k2 in cache.pinned and all(block.ref_cnt == 1 for block in entry.all_blocks())
    cache.let_go("t3")  # it finished
    cache.release_idle()
    assert k2 not in cache.pinned and k2 in cache.entries
    pool.get_new_blocks(pool.get_num_free_blocks())  # the pool reclaims everything
    assert not cache.entries and not cache.chains and cache.find_chain(taker, settings, 16, BLOCK) is None


@pytest.mark.parametrize("raw, error", [
    ({"policy": "paged", "budget": 64, "decode_eviction": False, "chain": True},
     "chain=true carries a turn's compressed"),
    ({**CONTEXT, "chain": "yes"}, "chain must be true or false"),
    ({**CONTEXT, "budget_schedule": "attention", "chain": True}, "chain=true, but budget_schedule=attention"),
])
def test_a_chain_that_cannot_apply_is_refused_with_its_reason(raw, error):
    with pytest.raises(ValueError, match=error):
        parse_settings(raw, "request kv_eviction")


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "tova"])
def test_a_chain_is_refused_for_a_policy_that_reads_queries(policy):
    from harness.eviction.settings import admit

    settings = parse_settings({"policy": policy, "budget": 64, "decode_eviction": False, "compress": "context",
                               "chain": True}, "request")
    with pytest.raises(ValueError, match="a chained turn carries the previous turn's kept K/V, not its queries"):
        admit(settings, 32, 30, 1, enforce_eager=True, async_scheduling=False)
    admit(replace(settings, chain=False), 32, 30, 1, enforce_eager=True, async_scheduling=False)


def test_the_chain_setting_travels_names_a_cell_only_when_set_and_keys_by_its_ratio():
    on = parse_settings({**CONTEXT, "chain": True}, "request")
    assert on.chain and parse_settings(on.as_dict(), "again") == on and on.identity()["chain"] is True
    plain = parse_settings(CONTEXT, "request")
    assert not plain.chain and "chain" not in plain.as_dict() and "chain" not in plain.identity()
    assert on.key != plain.key  # a chained context's entries are never a recompressing request's
    assert on.slug().endswith("_chain") and "chain=true" in on.variant_marks() and on.label().endswith("chained")
    ratio = parse_settings({**CONTEXT, "budget": None, "budget_ratio": 0.5, "chain": True}, "request")
    turn1, turn2 = ratio.at_context(300).for_prompt(320, 32), ratio.at_context(600).for_prompt(640, 32)
    assert turn1.budget != turn2.budget and turn1.chain_key == turn2.chain_key  # the budget: each turn's own history
    assert on.chain_key == on.key  # a token budget is the same every turn

"""The compressed-context cache's references on vLLM's own block pool (``harness.engine.shared_contexts``):
an entry pins its blocks while requests hold them, lets them go like the prefix cache once none does
(free, at the queue's tail, found again until the pool hands one out), and refuses a write into a
kept block. The share setting is checked with the other settings. The engine tests
(``tests/engine/test_context_compression.py`` and the tensor-parallel and layer-group ones) show
that requests taking an entry generate what they generate computing their own."""
from __future__ import annotations

import pytest
from vllm.v1.core.block_pool import BlockPool

from harness.engine.shared_contexts import ContextCache, context_key
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

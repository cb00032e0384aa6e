"""The compressed-context cache's references on vLLM's own block pool (``harness.engine.shared_contexts``):
an entry pins its blocks while requests hold them, lets them go like the prefix cache once none does
(free, at the queue's tail, found again until the pool hands one out), and refuses a write into a
kept block. The share setting is checked with the other settings. Chained turns (``chain=true``)
on the real scheduler: a turn holds its conversation's history once (blocks in use equal to its
recompressing twin's), and preemption, aborts and a second taker keep the oracle's K/V and give
every block back. The engine tests
(``tests/engine/test_context_compression.py`` and the tensor-parallel and layer-group ones) show
that requests taking an entry generate what they generate computing their own."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens, init_none_hash
from vllm.v1.request import Request

from harness.engine.shared_contexts import ContextCache, chain_entry_key, context_key
from harness.eviction.settings import CONFIG_KEY, EvictionSettings, parse_settings
from tests.unit.test_chain_scheduler import CopyingWorker

BLOCK = 4
# vLLM's block hashes as an engine computes them: its default hash (CacheConfig's
# prefix_caching_hash_algo), the seed it starts every chain from, and its per-request hasher
# (as vllm/v1/engine/core.py:236-240 builds it; vllm/v1/core/kv_cache_utils.py:941-1000)
HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)
HASHER = get_request_block_hasher(BLOCK, HASH)


def request(tokens=None, rid: str = "r", **vllm_inputs) -> Request:
    """A real vLLM request with its block hashes (token ids, or ``prompt_embeds=`` and the other
    inputs vLLM keys blocks by: ``lora_request``, ``cache_salt``, ``mm_features``)."""
    return Request(rid, None if tokens is None else list(tokens), SamplingParams(max_tokens=4), None,
                   block_hasher=HASHER, **vllm_inputs)


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
    settings = EvictionSettings("paged", 8, compress="context", context_tokens=6, decode_eviction=False)
    one, two = request([1, 2, 3, 4, 5, 6, 7, 8, 9]), request([1, 2, 3, 4, 5, 6, 9, 9, 9])
    assert context_key(one, settings, BLOCK) == context_key(two, settings, BLOCK)  # the question is not in it
    assert context_key(one, settings, BLOCK)[:2] == (one.block_hashes[0], ((5, 6), None))
    assert context_key(request([1, 2, 3, 4, 5, 0, 7, 8]), settings, BLOCK) != context_key(one, settings, BLOCK)
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

def Turn(tokens, **vllm_inputs) -> Request:
    """A turn's tokens (its prompt and answer) in a real vLLM request, with vLLM's chained hashes of
    its whole blocks (kv_cache_utils.py:695-725; they cover the answer as it grows, request.py:272-288)."""
    return request(tokens, **vllm_inputs)


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


# --- keys that cannot collide: a partial last block named by vLLM's own extra keys ----------------
# (issue 63: token ids alone name neither a prompt given as embeddings, all-zero ids, nor a
# multimodal item's placeholders; vLLM's whole-block hashes carry them as extra keys,
# vllm/v1/core/kv_cache_utils.py:625-663, and so does the tail of every key here)

SIX = EvictionSettings("paged", 8, compress="context", context_tokens=6, decode_eviction=False)  # a whole block and 2


def embeddings(rows: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))


def tail_hash(key) -> bytes:
    """What vLLM would hash the key's partial block to once whole (kv_cache_utils.py:695-725)."""
    parent, (ids, extra) = (key[1], key[2]) if key[0] == "chain" else (key[0], key[1])
    return hash_block_tokens(HASH, parent, ids, extra)


def test_prompts_given_as_embeddings_differing_only_inside_the_partial_last_block_get_two_keys():
    """Two 9-token prompts as embeddings (every token id 0: vllm/v1/request.py:147-148), equal but for
    token 5, inside the 6-token context's partial block: vLLM's hash of their whole block is one,
    the token ids of their tail are one, and still their keys differ (vLLM's digest of the tail's
    embeddings, kv_cache_utils.py:598-622), as vLLM's own hash of that tail would. Identical
    embeddings (another question after the context) still share; the same ids given as ids do not."""
    base = embeddings()
    changed = base.clone()
    changed[5] += 1.0
    one, other = request(prompt_embeds=base), request(prompt_embeds=changed)
    assert list(one.all_token_ids) == list(other.all_token_ids) == [0] * 9
    assert one.block_hashes[0] == other.block_hashes[0]  # the difference is in no whole block
    key_one, key_other = context_key(one, SIX, BLOCK), context_key(other, SIX, BLOCK)
    assert key_one[1][0] == key_other[1][0] == (0, 0)  # the old key: token ids alone, one entry
    assert key_one != key_other
    assert tail_hash(key_one) != tail_hash(key_other)  # vLLM's hashing tells them apart the same way
    question = base.clone()
    question[6:] = embeddings(3, seed=1)  # the same context, another question
    assert context_key(request(prompt_embeds=question), SIX, BLOCK) == key_one
    assert context_key(request(prompt_embeds=base.clone()), SIX, BLOCK) == key_one
    assert context_key(request([0] * 9), SIX, BLOCK) != key_one  # ids 0 are not these embeddings


def test_a_multimodal_placeholder_inside_the_partial_last_block_is_keyed_by_its_item_and_offset():
    """A unit test on vLLM's hashing: two prompts with the same placeholder ids, an image's two
    placeholder tokens at 4-5 (the 6-token context's partial block). Another image there, or the
    same image one token later, is another key (vLLM's ("mm", identifier, offset) keys,
    kv_cache_utils.py:510-575), as vLLM's hash of that tail would be; the same image is one."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def image(identifier, offset, length=2):
        return [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                      mm_position=PlaceholderRange(offset=offset, length=length))]

    tokens = [1, 2, 3, 4, 7, 7, 7, 8, 9]  # 7: the image placeholder id
    one = request(tokens, mm_features=image("img-a", 4))
    keys = [context_key(request(tokens, mm_features=features), SIX, BLOCK)
            for features in (image("img-a", 4), image("img-b", 4), image("img-a", 5, 1), [])]
    assert all(request(tokens, mm_features=f).block_hashes[0] == one.block_hashes[0]
               for f in (image("img-b", 4), []))  # no whole block holds the image
    assert keys[0] == context_key(one, SIX, BLOCK) and keys[0][1] == ((7, 7), (("mm", "img-a", 0),))
    assert len(set(keys)) == 4
    assert len({tail_hash(key) for key in keys}) == 4


def test_a_lora_or_a_cache_salt_is_another_entry_and_identical_prompts_are_one():
    """LoRA and cache salt reach the key through vLLM's block hash (the LoRA on every block, the salt
    on the first: kv_cache_utils.py:578-595, 646-651) and the LoRA through the tail's extra keys too."""
    from vllm.lora.request import LoRARequest

    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    lora_a, lora_b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    base = context_key(request(tokens), SIX, BLOCK)
    assert context_key(request(tokens, rid="again"), SIX, BLOCK) == base
    with_a = context_key(request(tokens, lora_request=lora_a), SIX, BLOCK)
    assert with_a == context_key(request(tokens, lora_request=LoRARequest("a", 1, "/adapters/a")), SIX, BLOCK)
    assert with_a[1] == ((5, 6), (("lora", "a", "/adapters/a"),))
    assert len({base, with_a, context_key(request(tokens, lora_request=lora_b), SIX, BLOCK),
                context_key(request(tokens, lora_request=LoRARequest("a", 1, "/adapters/a2")), SIX, BLOCK)}) == 4
    salted = context_key(request(tokens, cache_salt="s"), SIX, BLOCK)
    assert salted == context_key(request(tokens, cache_salt="s"), SIX, BLOCK)
    assert len({base, salted, context_key(request(tokens, cache_salt="t"), SIX, BLOCK)}) == 3
    # the same for a chain entry's key
    chained = [chain_entry_key(request(tokens, **inputs), CHAIN, 6, BLOCK)
               for inputs in ({}, {"lora_request": lora_a}, {"cache_salt": "s"})]
    assert len(set(chained)) == 3 and chained[0] == chain_entry_key(request(tokens), CHAIN, 6, BLOCK)


def test_a_chain_entry_is_not_found_by_a_turn_whose_embeddings_differ_inside_its_partial_block():
    """A turn given as embeddings publishes its first 10 tokens (two whole blocks and 2): a later
    turn whose embeddings begin with the same ones finds it; one differing only at token 9 (all
    ids 0, the whole blocks' hashes the same) does not."""
    pool, cache = pool_and_cache()
    history = embeddings(15)
    first = Turn(None, prompt_embeds=history[:11].clone())
    key = chain_entry_key(first, CHAIN, 10, BLOCK)
    assert cache.publish(key, "turn1", 10, (6,), (compressed(pool, 2),))
    settings = CHAIN.at_context(11).for_prompt(15, BLOCK)
    assert cache.find_chain(Turn(None, prompt_embeds=history.clone()), settings, 11, BLOCK) == key
    changed = history.clone()
    changed[9] += 1.0
    other = Turn(None, prompt_embeds=changed)
    assert other.block_hashes[:2] == first.block_hashes[:2]
    assert cache.find_chain(other, settings, 11, BLOCK) is None
    assert chain_entry_key(other, CHAIN, 10, BLOCK) != key


CONTEXT_TOKENS, QUESTION, OUTPUTS, BUDGET = 14, 5, 6, 8


def test_the_scheduler_never_shares_a_context_between_embeddings_that_differ_in_its_partial_block():
    """The real scheduler with prefix caching, a real block pool and vLLM's block hasher, the fake
    worker (``test_chain_scheduler``): three questions as embeddings about a 14-token context
    (whole blocks 0-11, a partial block 12-13), PagedEviction at a budget of 8, all at once. The
    second's context differs from the first's only at token 13: it compresses its own (two entries
    published, two misses); the third's context is the first's: it takes that entry (one hit)."""
    from tests.unit.test_async_scheduling import make_scheduler
    from tests.unit.test_chain_scheduler import CopyingWorker, drive

    class EmbeddingsWorker(CopyingWorker):
        """The fake worker reads a new request's prompt length from its token ids, which a prompt
        given as embeddings has none of (vllm/v1/core/sched/output.py:41-51): its length instead."""

        def step(self, output):
            for new in output.scheduled_new_reqs:
                if new.prompt_token_ids is None:
                    new.prompt_token_ids = [0] * len(new.prompt_embeds)
            return super().step(output)

    pool = 64
    scheduler = make_scheduler(False, pool, prefix_caching=True)
    assert scheduler.kv_cache_manager.block_pool.hash_block_size == BLOCK
    hasher = get_request_block_hasher(BLOCK, get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo))
    worker = EmbeddingsWorker(pool, scheduler)
    raw = {"policy": "paged", "budget": BUDGET, "decode_eviction": False, "compress": "context",
           "context_tokens": CONTEXT_TOKENS}
    context = embeddings(CONTEXT_TOKENS, seed=2)
    changed = context.clone()
    changed[13] += 1.0
    for index, ctx in enumerate((context, changed, context)):
        prompt = torch.cat([ctx, embeddings(QUESTION, seed=10 + index)])
        params = SamplingParams(max_tokens=OUTPUTS, ignore_eos=True, extra_args={CONFIG_KEY: raw})
        scheduler.add_request(Request(f"r{index + 1}", None, params, None, prompt_embeds=prompt, block_hasher=hasher))
    keys = scheduler.kv_sharing.keys
    assert keys["r1"] == keys["r3"] != keys["r2"] and keys["r1"][0] == keys["r2"][0]
    drive(scheduler, worker, asynchronous=False)

    stats = scheduler.kv_contexts.stats
    assert (stats.published, stats.hits, stats.misses) == (2, 1, 2)
    assert {entry.owner for entry in scheduler.kv_contexts.entries.values()} == {"r1", "r2"}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == pool - 1
    assert not scheduler.kv_contexts.pinned


# --- a chained turn holds its conversation's history once -----------------------------------------
# (issue 64, item 3.) The real scheduler with prefix caching and a real block pool, vLLM's block
# hasher and the fake worker of ``test_chain_scheduler`` (K/V written at the plan's physical slots,
# the harness's own step driver evicting, vLLM's copy-on-write copies carried out, every chain
# entry's kept slots checked unchanged after every step). A turn compacts its history into blocks of
# its own (its copy targets) and so no longer needs the entry it took once its boundary eviction has
# run: it lets go of it then (``ContextSharing.release_continued``), not when it finishes, and from
# there holds only its own blocks, as its recompressing twin does.


class TalkWorker(CopyingWorker):
    """``test_chain_scheduler``'s worker, which also lets a request end that it never ran (aborted
    while waiting), as vLLM's model runner does (``self.requests.pop(req_id, None)``:
    vllm/v1/worker/gpu_model_runner.py:1183-1185)."""

    def step(self, output):
        output.finished_req_ids = {rid for rid in output.finished_req_ids if rid in self.requests}
        return super().step(output)


class Talk:
    """Conversations of ``test_chain_scheduler``'s shape (a 37-token prompt, its context 24
    tokens, 6 outputs a turn, a 5-token message after each answer), turn by turn, with hooks into
    the drive; and the oracle of one contiguous cache per conversation (``test_chain_scheduler.Oracle``)."""

    def __init__(self, name: str, chain: bool = True, asynchronous: bool = False, pool: int = 160,
                 conversations: int = 2):
        from tests.unit import test_chain_scheduler as talk
        from tests.unit.test_async_scheduling import make_scheduler

        self.talk, self.name, self.chain, self.asynchronous, self.pool = talk, name, chain, asynchronous, pool
        self.scheduler = make_scheduler(asynchronous, pool, prefix_caching=True)
        self.hasher = get_request_block_hasher(BLOCK, get_hash_fn_by_name(
            self.scheduler.cache_config.prefix_caching_hash_algo))
        self.worker = TalkWorker(pool, self.scheduler)
        self.prompts = [[100 + c] * talk.PROMPT for c in range(conversations)]
        self.boundaries = [talk.CONTEXT] * conversations
        self.asked: dict[str, tuple] = {}  # request -> (settings, prompt, boundary)

    def ask(self, c: int, rid: str, prompt: list[int] | None = None, boundary: int | None = None) -> None:
        prompt = self.prompts[c] if prompt is None else prompt
        boundary = self.boundaries[c] if boundary is None else boundary
        raw = self.talk.settings_of(self.name, boundary, chain=self.chain)
        params = SamplingParams(max_tokens=self.talk.OUTPUTS, ignore_eos=True, extra_args={CONFIG_KEY: raw})
        self.scheduler.add_request(Request(rid, list(prompt), params, None, block_hasher=self.hasher))
        self.asked[rid] = (parse_settings(raw, "test").for_prompt(len(prompt), BLOCK), len(prompt), boundary)

    def answer(self, c: int, turn: int) -> None:
        """The next turn's prompt: this one's, its answer (the worker's token) and a message."""
        talk = self.talk
        self.boundaries[c] = len(self.prompts[c]) + talk.OUTPUTS
        self.prompts[c] = self.prompts[c] + [5] * talk.OUTPUTS + [200 + 10 * c + turn] * talk.MESSAGE

    def drive(self, before_schedule=lambda: None, after_update=lambda queue: None) -> None:
        def checked(queue):
            self.worker.check_entries()
            after_update(queue)

        self.talk.drive(self.scheduler, self.worker, self.asynchronous, before_schedule, checked)
        self.worker.step(self.scheduler.schedule())  # the last finished requests' blocks reach the worker

    def used(self) -> int:
        return self.scheduler.kv_ledger.pool_blocks - self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def held(self) -> int:
        """The distinct blocks the running requests hold, every group."""
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        return len({block.block_id for manager in managers for request in self.scheduler.running
                    for block in manager.req_to_blocks.get(request.request_id, ())})

    def expect(self, turns: list[str], groups: int = 1) -> list[torch.Tensor]:
        """What the oracle holds after these requests of one conversation, in order."""
        oracle = self.talk.Oracle(groups)
        for rid in turns:
            settings, prompt, boundary = self.asked[rid]
            held = oracle.turn(rid, settings, prompt, boundary, self.talk.OUTPUTS)
        return held

    def all_back(self) -> None:
        contexts = self.scheduler.kv_contexts
        assert self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == self.pool - 1
        assert not contexts.holders and not contexts.pinned
        assert not self.scheduler.kv_sharing.continuing and not self.scheduler.kv_sharing.resuming


def talk_three_turns(name: str, chain: bool, asynchronous: bool = False, after_update=None):
    """Two conversations, three turns each, every conversation's turn at once; per later turn, after
    every step (once every report is in), the blocks in use and the blocks the running requests hold,
    under the running requests' logical lengths; and the ledger's mean blocks in use over later turns."""
    talk = Talk(name, chain, asynchronous)
    steps: dict[tuple, tuple[int, int]] = {}

    def record(queue):
        scheduler = talk.scheduler
        if scheduler.kv_expected or not scheduler.running:
            return
        # every running request past its boundary eviction (its question and answer), a later turn
        if all(request.num_computed_tokens > scheduler.eviction_point(request) and request.request_id[-1] != "0"
               for request in scheduler.running):
            state = tuple(sorted((r.request_id, r.num_computed_tokens) for r in scheduler.running))
            steps[state] = (talk.used(), talk.held())

    for turn in range(talk.talk.TURNS):
        if turn == 1:
            talk.scheduler.kv_ledger.reset_measurements()  # later turns only
        for c in range(2):
            talk.ask(c, talk.talk.request_id(c, turn))
        talk.drive(after_update=record)
        for c in range(2):
            talk.answer(c, turn)
    ledger = talk.scheduler.kv_ledger.snapshot()
    return talk, steps, ledger["kv_blocks_used_mean"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["paged", "knorm", "streaming"])
def test_a_chained_turn_holds_the_history_once_as_many_blocks_as_its_recompressing_twin(name, asynchronous):
    """After its boundary eviction a chained turn's blocks in use are the blocks it holds itself
    (the entry it took is released, not pinned beside its own compressed copy), step for step the
    same count as the same conversation recompressing its pristine history each turn; over the
    later turns its mean blocks in use are at most the twin's (it also computes fewer tokens)."""
    chained, steps, mean = talk_three_turns(name, chain=True, asynchronous=asynchronous)
    twin, twin_steps, twin_mean = talk_three_turns(name, chain=False, asynchronous=asynchronous)
    assert chained.scheduler.kv_contexts.stats.chain_hits == 4 and twin.scheduler.kv_contexts.stats.chain_hits == 0
    assert steps and set(steps) == set(twin_steps), "both ran the same later-turn decode steps"
    for state, (used, held) in steps.items():
        assert used == held, f"{state}: {used} blocks in use, the running turns hold {held}: an entry held beside them"
        twin_used = twin_steps[state][0]
        assert used == twin_used, f"{state}: {used} blocks in use, the recompressing twin {twin_used}"
    assert mean <= twin_mean, (mean, twin_mean)
    # the K/V each turn ended with is the oracle's (the same evictions through one contiguous cache)
    for c in range(2):
        turns = [chained.talk.request_id(c, turn) for turn in range(chained.talk.TURNS)]
        for index in range(len(turns)):
            assert torch.equal(chained.worker.kept[turns[index]][0], chained.expect(turns[: index + 1])[0])
    chained.all_back()
    twin.all_back()


def first_two_turns(talk: Talk) -> list[str]:
    """Turns 0 and 1 of both conversations, run to the end; the turn-2 request ids."""
    for turn in range(2):
        for c in range(2):
            talk.ask(c, talk.talk.request_id(c, turn))
        talk.drive()
        for c in range(2):
            talk.answer(c, turn)
    return [talk.talk.request_id(c, 2) for c in range(2)]


def past_its_eviction(talk: Talk, rid: str) -> bool:
    scheduler = talk.scheduler
    request = scheduler.requests.get(rid)
    return (request is not None and request in scheduler.running and rid not in scheduler.kv_sharing.continuing
            and request.num_computed_tokens > scheduler.eviction_point(request) and not any(
                (rid, g) in scheduler.kv_expected for g in range(scheduler.kv_groups)))


@pytest.mark.parametrize("asynchronous, when", [(False, "answer"), (True, "answer"), (True, "report")],
                         ids=["sync-mid-answer", "async-mid-answer", "async-eviction-in-flight"])
@pytest.mark.parametrize("name", ["paged", "knorm"])
def test_a_turn_preempted_after_its_eviction_resumes_its_own_kept_cache_though_its_entry_is_reclaimed(
        name, asynchronous, when):
    """vLLM preempts a chained turn (its own ``_preempt_request``, as ``schedule`` does when the pool
    runs out: vllm/v1/core/sched/scheduler.py:1571-1614) after its boundary eviction: mid-answer, or,
    under asynchronous scheduling, while the step that evicts is still in flight (its report not in);
    then the pool hands out every free block, so the entry the turn took is reclaimed. The turn left
    its own kept cache as an entry held for it (``ContextSharing.keep_preempted``): its replay takes
    that back and ends with the oracle's K/V (recompressing the pristine history instead would keep
    other tokens); while it waits, the pool holds its kept cache once; every block comes back."""
    import time

    talk = Talk(name, asynchronous=asynchronous)
    later = first_two_turns(talk)
    victim = later[0]
    for c in range(2):
        talk.ask(c, later[c])
    scheduler, pool = talk.scheduler, talk.scheduler.kv_cache_manager.block_pool
    seen = {}

    def due() -> bool:
        request = scheduler.requests.get(victim)
        if when == "answer":
            return past_its_eviction(talk, victim) and request.num_output_tokens >= 2
        return request is not None and request in scheduler.running and (victim, 0) in scheduler.kv_expected

    def preempt():
        if seen or not due():
            return
        request = scheduler.requests[victim]
        taken = {key for key, holders in scheduler.kv_contexts.holders.items() if victim in holders}
        assert not taken, "a turn past its eviction holds no entry it took"
        scheduler.running.remove(request)
        scheduler._preempt_request(request, time.monotonic())
        own = scheduler.kv_sharing.resuming[victim]
        entry = scheduler.kv_contexts.entries[own]
        assert entry.owner == victim and own in scheduler.kv_contexts.pinned
        assert victim in scheduler.kv_contexts.holders[own]
        assert entry.length >= scheduler.eviction_point(request)
        # the pool hands out every free block: the entries nobody holds (the one the turn took) go
        before = scheduler.kv_contexts.stats.reclaimed
        pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
        seen["reclaimed"] = scheduler.kv_contexts.stats.reclaimed - before
        assert own in scheduler.kv_contexts.entries
        # in use now: the other turn's blocks and the preempted turn's kept cache, once
        seen["used"], seen["expected"] = talk.used(), talk.held() + entry.block_count

    talk.drive(before_schedule=preempt)
    assert seen, "the turn was never preempted past its eviction"
    assert seen["reclaimed"] >= 1, "the entry the turn took was not reclaimed"
    assert seen["used"] == seen["expected"]
    assert talk.worker.resumed >= 1
    counters = scheduler.kv_request_counters[victim]
    assert counters.chain_hits == 2 and counters.chain_misses == 0, "the replay took its own kept cache"
    assert scheduler.kv_contexts.stats.chain_misses == 2  # the first turns only
    for c, rid in enumerate(later):
        turns = [talk.talk.request_id(c, 0), talk.talk.request_id(c, 1), rid]
        assert torch.equal(talk.worker.kept[rid][0], talk.expect(turns)[0]), rid
    talk.all_back()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_turn_preempted_before_its_eviction_still_holds_the_entry_it_took(asynchronous):
    """Preempted after taking the previous turn's entry but before reaching its boundary (its new
    tokens prefilled one per step; its boundary three tokens into its message, so that there are
    tokens to prefill after the entry's end), a turn keeps holding that entry, so the pool cannot
    reclaim it, and the replay takes it again and ends with the oracle's K/V."""
    import time

    talk = Talk("paged", asynchronous=asynchronous)
    later = first_two_turns(talk)
    victim = later[0]
    talk.ask(0, victim, boundary=talk.boundaries[0] + 3)  # (alone: the other conversation's entry is let go)
    scheduler, pool = talk.scheduler, talk.scheduler.kv_cache_manager.block_pool
    seen = {}

    def preempt():
        request = scheduler.requests.get(victim)
        if seen or request is None or request not in scheduler.running or victim not in scheduler.kv_sharing.continuing:
            return
        key = scheduler.kv_sharing.continuing[victim]
        scheduler.running.remove(request)
        scheduler._preempt_request(request, time.monotonic())
        assert victim not in scheduler.kv_sharing.resuming
        pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
        seen["kept"] = key in scheduler.kv_contexts.entries

    # one token a step (vLLM's step budget, vllm/v1/core/sched/scheduler.py:137, 611), so that the turn
    # is preempted before it reaches its boundary
    talk.scheduler.max_num_scheduled_tokens = 1
    talk.drive(before_schedule=preempt)
    assert seen == {"kept": True}
    assert scheduler.kv_request_counters[victim].chain_hits == 2
    turns = [talk.talk.request_id(0, 0), talk.talk.request_id(0, 1), victim]
    assert torch.equal(talk.worker.kept[victim][0], talk.expect(turns)[0])
    talk.all_back()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_aborted_turns_give_every_block_back(asynchronous):
    """One later turn aborted mid-answer after its eviction, the other before it has been scheduled:
    every block comes back, no entry is held or pinned, and the entries stand for the next turns."""
    from vllm.v1.request import RequestStatus

    talk = Talk("paged", asynchronous=asynchronous)
    later = first_two_turns(talk)
    for c in range(2):
        talk.ask(c, later[c])
    scheduler = talk.scheduler
    scheduler.finish_requests(later[1], RequestStatus.FINISHED_ABORTED)  # waiting: never scheduled
    done = {}

    def abort():
        if not done and past_its_eviction(talk, later[0]):
            scheduler.finish_requests(later[0], RequestStatus.FINISHED_ABORTED)
            done["aborted"] = True

    talk.drive(before_schedule=abort)
    assert done
    talk.all_back()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["paged", "knorm"])
def test_a_second_turn_taking_the_same_entry_meanwhile_reads_it_unchanged(name, asynchronous):
    """Two requests continue one conversation's second turn with different messages (a branch):
    the first runs past its eviction and lets go of the entry (it is free then, found again); the
    second arrives and takes the same entry, copying its partial last block (vLLM's copy-on-write)
    and compacting into blocks of its own. No entry slot is ever written (checked after every step),
    and each branch ends with its own oracle's K/V."""
    talk = Talk(name, asynchronous=asynchronous)
    first_two_turns(talk)
    history, boundary = list(talk.prompts[0]), talk.boundaries[0]
    # the same history as far as the entry goes (the previous prompt and all but its last answer token),
    # then another last answer token and message: not the same context, so it cannot take the first
    # branch's compressed context (``context_key``), only the chain entry both continue
    branch = history[: boundary - 1] + [6] + [77] * talk.talk.MESSAGE
    talk.ask(0, "r13")
    scheduler = talk.scheduler
    seen = {}

    def second():
        if not seen and past_its_eviction(talk, "r13"):
            entry = scheduler.kv_contexts.entries[scheduler.kv_contexts.find_chain(
                scheduler.requests["r13"], scheduler.kv_request_settings["r13"], boundary, BLOCK)]
            seen["released"] = entry.key not in scheduler.kv_contexts.pinned
            talk.ask(0, "r19", prompt=branch, boundary=boundary)

    talk.drive(before_schedule=second)
    assert seen == {"released": True}, "the first branch let go of the entry before the second came"
    counters = scheduler.kv_request_counters
    assert counters["r13"].chain_hits == counters["r19"].chain_hits == 1
    assert talk.worker.copies >= 2 + 2, "each branch copied the entry's partial last block"
    for rid in ("r13", "r19"):
        assert torch.equal(talk.worker.kept[rid][0], talk.expect(["r10", "r11", rid])[0]), rid
    talk.all_back()

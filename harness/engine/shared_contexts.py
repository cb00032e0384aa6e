"""Compress once, serve many: a context compressed by one request, shared by every later request
that asks about it with the same settings (``compress=context``).

vLLM's prefix cache cannot hold a compressed context: a block is named by the hash of the tokens it
logically holds (``vllm/v1/core/kv_cache_utils.py:695-725``), and a compressed block holds some of
them. This cache, kept by the scheduler (``harness.engine.scheduler``), names an entry by what
decides the compressed context instead:

* the context's logical tokens: vLLM's own chained hash of its last whole block (which covers every
  block before it, and the request's LoRA, cache salt, multimodal and prompt-embedding keys:
  ``kv_cache_utils.py:625-663``), and its partial last block, which no hash covers without question
  tokens, as vLLM would hash it once whole: its token ids and vLLM's extra keys for that token range
  (``tail_key``). Token ids alone do not name a block: a prompt given as embeddings has all-zero ids
  (``vllm/v1/request.py:147-148``) and a multimodal item's placeholder ids are the same for every
  image; the extra keys carry the embeddings' digest and the item's identifier and offset;
* every setting that decides what is kept (``EvictionSettings.key``: policy and options, budget or
  ratio, schedule); the block size, layer groups, model and dtype are the engine's, one per cache.

An entry is, per KV cache group, the blocks the first request kept and how many tokens they hold
(``kept``), standing for ``length`` logical tokens. A later request takes them as vLLM takes a
prefix-cache hit (``get_computed_blocks``: their references go up, its computed tokens are the
context's logical length) and prefills its question only, at the logical positions it would have
had; a partial last kept block (a compressed context is whole blocks, ``Policy.whole_blocks``, but a
context no longer than its budget is kept whole, and a chain entry ends after its answer) is copied
into the request's own by vLLM's copy-on-write of a partial hit
(``single_type_kv_cache_manager.py:163-173, 318-324, 388-397, 454-473``) before its question is
written, so no entry block is ever written after it is published (the first request's own partial
block excepted: it writes its question past the kept slots, which readers copy and overwrite).

Chains (``chain=true``, multi-turn conversations). A chained request that compressed its context
publishes, when it finishes, its whole kept cache (kept context, question and answer: per group its
first ``cdiv(kept, block)`` blocks) as a *chain entry* standing for the ``prompt + output - 1``
logical tokens it computed (the last output token's K/V is never computed), keyed like a context
entry by those tokens (``chain_entry_key``) and ``EvictionSettings.chain_key`` (a ratio's budget
unresolved: the next turn resolves it against its own history). The next turn, whose prompt begins
with those tokens, finds it (``ContextCache.find_chain``: the longest entry shorter than its context
boundary) and takes it as a context hit of that logical length; it prefills its new tokens up to its
boundary, and its prefill eviction there compresses the kept history with them, writing compaction
copies instead of any entry block (the scheduler's copy targets, one per kept position an entry block
holds); the entry's partial last block is copied by vLLM's partial-hit copy-on-write before the turn
writes its first token (as for a context entry, above; the worker runs the copy before the forward
pass: ``gpu_model_runner.py:1203-1208``, ``scheduler.py:1474-1483``). Its budget is the one
recompression would have (a ratio of the turn's whole logical history), so chain and recompression
hold as many tokens each turn. A request that took a chain entry holds it (``hold``) only until the
plan that schedules its boundary eviction: from there its compaction writes blocks of its own and
the entry's blocks are no longer in its block list, so it lets go (``ContextSharing.release_continued``)
and the entry is released at once, like any idle entry. A turn holds the conversation's history
once: the entry's blocks before its eviction, its own compressed copy after (its recompressing twin
holds the pristine history, then its copy, the same way). A turn preempted before its eviction still
holds the entry and takes it again; one preempted after it leaves its own kept cache as a chain
entry held for it (``ContextSharing.keep_preempted``), which its replay takes back, eviction done
(if nothing can run while such holds fill the pool, the scheduler lets them go). An entry no
request holds is reclaimed like any idle entry: the turn that needed it then compresses the
pristine history again (a chain miss).
The key names the tokens, not where earlier turns put their boundaries: in a conversation the
template's turn headers, which the tokens hold, fix them.

References. While a request holds an entry's blocks the cache holds one reference more (``touch``),
so nothing reclaims them. Once no request holds them, the cache lets them go as vLLM's prefix cache
lets its blocks go: ``unpin_blocks`` puts them at the free queue's tail (they count as free, and are
reclaimed least recently used, after blocks nobody can find), and its watcher drops the entry when
vLLM hands one of them out (``block_pool.py:683-684, 702-727``). A later hit pins them again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys


@dataclass
class Entry:
    """A compressed context: per KV cache group, its kept blocks and the tokens they hold."""

    key: tuple
    owner: str                        # the request that compressed it (it writes its question on)
    length: int                       # the logical tokens it stands for (the context)
    kept: tuple[int, ...]             # per group, the tokens its blocks hold
    blocks: tuple[tuple, ...]         # per group, the KVCacheBlocks
    chain: bool = False               # a finished turn's whole cache (no one writes on: its owner ended)

    def all_blocks(self):
        return [block for group in self.blocks for block in group]

    @property
    def block_count(self) -> int:
        return sum(len(group) for group in self.blocks)


@dataclass
class ContextStats:
    """The cache's figures for a run: entries published, hits, misses (a request that compressed
    its context itself), waits (steps a request waited for another to compress its context), waits
    given up, blocks a hit took instead of computing and holding its own, entries reclaimed by the
    pool, the most blocks the cache held pinned at once, and the chain's entries and hits."""

    published: int = 0
    hits: int = 0
    misses: int = 0
    wait_steps: int = 0
    waits_given_up: int = 0
    blocks_shared: int = 0
    reclaimed: int = 0
    pinned_blocks_peak: int = 0
    # chain=true: finished turns' caches kept for the next turn, hits on them, and the logical tokens
    # those hits did not compute
    chain_published: int = 0
    chain_hits: int = 0
    chain_reused_tokens: int = 0
    chain_misses: int = 0  # chained requests scheduled without an entry (first turns; reclaimed ones)
    chain_holds_dropped: int = 0  # times nothing could run and the entries held for preempted turns were let go

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def tail_key(request, start: int, end: int) -> tuple:
    """A partial block (the request's tokens ``start``..``end``, after its last whole block) named as
    vLLM names a whole block, less the parent hash (the caller's key holds it): its token ids and
    vLLM's own extra keys for that range (``generate_block_hash_extra_keys``,
    ``vllm/v1/core/kv_cache_utils.py:625-663``: LoRA name and path, each multimodal item the range
    touches with its offset in it (:510-575), the SHA-256 of the range's prompt embeddings (:598-622);
    the cache salt only at token 0, which a tail never starts at). They are what
    ``hash_block_tokens`` (:695-725) hashes with the parent, so two tails are one key exactly where
    vLLM would give the block one hash; kept unhashed, they cannot collide at all.

    vLLM computes these keys for any token range (the per-request hasher calls it per whole block,
    :984-986; starting from multimodal index 0 it skips the items before the range, :547-556). For
    prompt embeddings it caches the digest on the request under the range (``_prompt_embeds_per_block_hashes``,
    :615-621): the digest of exactly that range, which vLLM's whole-block lookups (other ranges) never read."""
    end = min(end, len(request.all_token_ids))
    ids = tuple(request.all_token_ids[start:end])
    if start >= end:
        return ids, None  # no tail: the last whole block's hash names everything
    extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
    return ids, extra


def context_key(request, settings, hash_block_size: int) -> tuple | None:
    """The entry a request's context would be under (None where a context has no whole block: no
    policy compresses one, a budget being at least two blocks)."""
    length = settings.context_tokens
    whole = length // hash_block_size
    if whole == 0 or len(request.block_hashes) < whole:
        return None
    tail = tail_key(request, whole * hash_block_size, length)
    # A reconstructing policy's kept set also depends on the ids it repeated the context with (the
    # request's own, not in the settings' key): a context compressed with other ids is another entry.
    return request.block_hashes[whole - 1], tail, settings.key, settings.reconstruction


def chain_entry_key(request, settings, length: int, hash_block_size: int) -> tuple | None:
    """The chain entry a request's first ``length`` logical tokens would be under (None where they
    hold no whole block, or its hash is not computed yet): vLLM's chained hash of the last whole
    block (``block_hashes`` grow with the outputs: ``vllm/v1/request.py:272-288``; each hash covers
    its whole prefix and the request's extra keys, ``kv_cache_utils.py:625-663, 695-725``), the
    partial block's ``tail_key`` and the settings' ``chain_key``."""
    whole = length // hash_block_size
    if whole == 0 or len(request.block_hashes) < whole:
        return None
    tail = tail_key(request, whole * hash_block_size, length)
    return "chain", request.block_hashes[whole - 1], tail, settings.chain_key


class ContextCache:
    """Entries by key (least recently used first), the requests compressing a context now (others
    asking about it wait for them), and the figures."""

    def __init__(self, block_pool):
        self.pool = block_pool
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        # the entries whose blocks the cache holds a reference on (the others' blocks are free):
        # what ``release_idle`` looks at, after every request's free, so not every entry kept
        self.pinned: dict[tuple, Entry] = {}
        self.owners: dict[tuple, str] = {}   # key -> the request compressing that context now
        self.pins: dict[int, int] = {}       # block id -> pinned entries holding it
        self.of_block: dict[int, set] = {}   # block id -> keys of the entries holding it
        # chain entries by (their last whole block's hash, settings): what find_chain looks up
        self.chains: dict[tuple, set] = {}
        self.holders: dict[tuple, set] = {}  # chain key -> requests holding it until they finish
        self.stats = ContextStats()

    def take(self, key: tuple) -> Entry | None:
        """The entry under ``key``, pinned, for a request about to hold its blocks."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        if key not in self.pinned:
            self._pin(entry)
        return entry

    def publish(self, key: tuple, owner: str, length: int, kept: tuple[int, ...], blocks: tuple[tuple, ...],
                counted: bool = True) -> bool:
        """Keep a context compressed by ``owner``, which holds ``blocks``; False if one is kept already.
        A chain key (``chain_entry_key``) keeps a finished turn's cache for the next turn (``counted``:
        in ``chain_published``; a preempted turn's own cache, kept for its replay, is not)."""
        if key in self.entries:
            return False
        chain = key[0] == "chain"
        entry = Entry(key, owner, length, tuple(kept), tuple(tuple(group) for group in blocks), chain)
        self.entries[key] = entry
        for block in entry.all_blocks():
            self.of_block.setdefault(block.block_id, set()).add(key)
        if chain:
            self.chains.setdefault((key[1], key[3]), set()).add(key)
            self.stats.chain_published += counted
        else:
            self.stats.published += 1
        self._pin(entry)
        return True

    def find_chain(self, request, settings, limit: int, hash_block_size: int) -> tuple | None:
        """The key of the longest chain entry under these settings whose logical tokens begin
        ``request`` and are fewer than ``limit`` (its context boundary: what it must still compute
        and compress), or None."""
        chain_key = settings.chain_key
        hashes = request.block_hashes
        for whole in range(min((limit - 1) // hash_block_size, len(hashes)), 0, -1):
            found = [self.entries[key] for key in self.chains.get((hashes[whole - 1], chain_key), ())
                     if key in self.entries]
            # the partial block named as the entry's (token ids and vLLM's extra keys: ``tail_key``)
            found = [entry for entry in found if entry.length < limit and
                     tail_key(request, whole * hash_block_size, entry.length) == entry.key[2]]
            if found:
                return max(found, key=lambda entry: entry.length).key
        return None

    def hold(self, key: tuple, request_id: str) -> None:
        """``request_id`` needs this entry again if it is preempted: it stays pinned until the request
        lets go of it (``let_go``)."""
        self.holders.setdefault(key, set()).add(request_id)

    def let_go(self, request_id: str, key: tuple | None = None) -> None:
        """``request_id`` no longer needs ``key`` (None: any entry); an entry nobody holds is
        released by the next ``release_idle`` once no request's blocks include its own."""
        for held in [key] if key is not None else list(self.holders):
            holders = self.holders.get(held)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self.holders[held]

    def release_idle(self) -> None:
        """Let go of the entries no request holds: their blocks become free, found again until the
        pool hands them out (then the entry is dropped)."""
        for entry in list(self.pinned.values()):
            if entry.key not in self.holders and \
                    all(block.ref_cnt == self.pins[block.block_id] for block in entry.all_blocks()):
                self._unpin(entry)

    def check_writes(self, request_id: str, group: int, blocks, first: int, last: int, block_size: int) -> None:
        """Refuse a step that writes a kept block (positions ``first``..``last`` of a request's
        ``blocks`` in ``group``): only the request that compressed an entry writes on, past the kept
        tokens of its partial last block."""
        for index in range(first, min(last, len(blocks) - 1) + 1):
            for key in self.of_block.get(blocks[index].block_id, ()):
                entry = self.entries[key]
                own_tail = (entry.owner == request_id and index == len(entry.blocks[group]) - 1
                            and entry.kept[group] % block_size and entry.blocks[group][index] is blocks[index])
                if not own_tail:
                    raise RuntimeError(f"request {request_id} would write block {blocks[index].block_id} (group "
                                       f"{group}, position {index}), which a shared compressed context holds")

    def clear(self) -> None:
        """Drop every entry (a prefix-cache reset: the weights may have changed)."""
        self.holders.clear()
        for entry in list(self.pinned.values()):
            self._unpin(entry)
        self.entries.clear()
        self.of_block.clear()
        self.chains.clear()

    def _pin(self, entry: Entry) -> None:
        blocks = entry.all_blocks()
        self.pool.touch(blocks)
        for block in blocks:
            self.pins[block.block_id] = self.pins.get(block.block_id, 0) + 1
        self.pinned[entry.key] = entry
        self.stats.pinned_blocks_peak = max(self.stats.pinned_blocks_peak, len(self.pins))

    def _unpin(self, entry: Entry) -> None:
        blocks = entry.all_blocks()
        for block in blocks:
            count = self.pins.pop(block.block_id) - 1
            if count:
                self.pins[block.block_id] = count
        del self.pinned[entry.key]
        # One watcher for every block (vLLM keeps one per block id): it finds the entries itself.
        self.pool.unpin_blocks(blocks, self._reused)

    def drop(self, key: tuple) -> None:
        """Forget an entry now (its blocks released, as an idle entry's, if it is pinned)."""
        entry = self.entries.get(key)
        if entry is None:
            return
        self.holders.pop(key, None)
        if key in self.pinned:
            self._unpin(entry)
        self._forget(key)

    def _reused(self, block) -> None:
        """vLLM handed out (or reset) a block an unpinned entry held: that entry is gone."""
        for key in self.of_block.pop(block.block_id, ()):
            if key in self.entries:
                self.stats.reclaimed += 1
                self._forget(key)

    def _forget(self, key: tuple) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            if entry.chain:
                siblings = self.chains.get((key[1], key[3]))
                if siblings is not None:
                    siblings.discard(key)
                    if not siblings:
                        del self.chains[(key[1], key[3])]
            for other in entry.all_blocks():
                keys = self.of_block.get(other.block_id)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self.of_block[other.block_id]

"""The scheduler's side of compressed contexts shared between requests and of chained turns
(``harness.engine.shared_contexts`` keeps the entries themselves: keys, blocks, references).

One ``ContextSharing`` per eviction scheduler whose engine shares contexts (prefix caching on, no
KV connector: ``EvictionScheduler._shares_contexts``). Through a request's life:

* admitted: a request that may share (``compress=context``, sharing exact for its settings) is
  recorded under its context's key (``admit``);
* waiting to be scheduled: it takes a kept entry as a prefix-cache hit of the context's logical
  length (``take``, called from the scheduler's ``get_computed_blocks``), or records that it
  compresses the context itself, so that others asking about it wait for it (``ready``, at most
  ``CONTEXT_WAIT_STEPS`` steps);
* after each schedule: the requests that took an entry and were scheduled hold it, the others
  give their claim back (``settle``); a chained turn whose boundary eviction the plan scheduled
  lets go of the chain entry it took, holding only its own compressed copy from there
  (``release_continued``);
* preempted: a chained turn past its boundary eviction leaves its own kept cache for its replay
  (``keep_preempted``);
* once a compressing request's every group reported its eviction: its kept blocks are published
  under the key (``publish_compressed``);
* finished: a ``chain=true`` turn leaves its whole kept cache to the next turn
  (``publish_chain``), and its records go (``forget``).

It reads the scheduler's own records (settings, evicted counts, pending evictions, counters) and
changes only its own and the entries'."""
from __future__ import annotations

from vllm.v1.request import RequestStatus

from harness.engine.shared_contexts import ContextCache, Entry, chain_entry_key
from harness.eviction.counters import RequestCounters
from harness.eviction.evictor import cdiv

# The most steps a request waits for another to compress its context (a long context compresses in
# as many chunks as it has: far fewer); then it compresses its own, and the figures count it.
CONTEXT_WAIT_STEPS = 256


class ContextSharing:
    def __init__(self, scheduler, cache: ContextCache):
        self.scheduler = scheduler
        self.cache = cache
        self.keys: dict[str, tuple] = {}          # live requests that may share: their context's key
        self.taking: dict[str, Entry] = {}        # took an entry in this schedule(), not yet scheduled
        self.compressing: dict[str, tuple] = {}   # compressing a context others wait for
        self.waits: dict[str, int] = {}           # steps a request has waited for its context
        self.chain_missed: set[str] = set()       # chained, found no chain entry in this schedule()
        # chained requests holding the chain entry they took until their boundary eviction has run
        # (``release_continued``), and preempted ones holding their own kept cache (``keep_preempted``)
        self.continuing: dict[str, tuple] = {}
        self.resuming: dict[str, tuple] = {}

    def admit(self, request_id: str, key: tuple) -> None:
        self.keys[request_id] = key

    def take(self, request):
        """A request about a context compressed and kept already takes its blocks as a prefix-cache
        hit of the context's logical length (its evicted counts set first, so its KV manager sizes
        it by what the blocks hold, and its question is prefilled at its logical positions): what
        ``get_computed_blocks`` returns, or None. One that compresses the context itself is
        recorded, so that others asking about it wait."""
        scheduler, request_id = self.scheduler, request.request_id
        key = self.keys.get(request_id)
        settings = scheduler.kv_request_settings.get(request_id)
        chained = settings is not None and settings.chain and request_id not in scheduler.kv_uncached
        if settings is not None and settings.chain and not chained:
            self.chain_missed.add(request_id)  # its copies could not fit: it compacts in place
        if key is None and not chained:
            return None
        length = settings.context_tokens
        own = self.resuming.get(request_id) if chained else None
        if own is not None and own in self.cache.entries and self.cache.entries[own].length <= request.num_tokens - 1:
            # A turn preempted after its boundary eviction: its own kept cache, as it left it (its
            # eviction is done; what it took is released). Before any other entry: it is this request's.
            entry = self.cache.take(own)
        else:
            entry = self.cache.take(key) if key is not None and length <= request.num_tokens - 1 else None
        if entry is None and chained:
            # The previous turn's kept cache (the longest chain entry shorter than this context: a
            # turn's boundary comes after that cache's last token, so what is left is computed here
            # and compressed with it). Never for a request kept out of the prefix cache: it would
            # compact in place, into the entry's blocks.
            found = self.cache.find_chain(request, settings, length,
                                          scheduler.kv_cache_manager.block_pool.hash_block_size)
            entry = self.cache.take(found) if found is not None else None
            if entry is None:
                self.chain_missed.add(request_id)  # counted if it is scheduled so (settle)
        if entry is None or (entry.chain and entry.length < length):
            policies = scheduler.group_policies(settings)
            if key is not None and any(policy.needs_prefill_eviction(length) for policy in policies):
                # the first compresses for everyone (the others wait: ready)
                self.cache.owners.setdefault(key, request_id)
                self.compressing[request_id] = key
        if entry is None:
            return None
        scheduler.kv_ledger.evicted[request_id] = [entry.length - kept for kept in entry.kept]
        self.taking[request_id] = entry
        blocks = scheduler.kv_cache_manager.create_kv_cache_blocks(tuple(list(group) for group in entry.blocks))
        return blocks, entry.length, 0

    def ready(self, request) -> bool:
        """Whether a waiting request may be scheduled as far as its context goes: not while another
        request is compressing it (it keeps its place), for at most ``CONTEXT_WAIT_STEPS`` steps;
        then it compresses its own."""
        request_id = request.request_id
        key = self.keys.get(request_id)
        if key is None or request.num_computed_tokens:
            return True
        owner = self.cache.owners.get(key)
        if owner is None or owner == request_id or key in self.cache.entries:
            return True
        waited = self.waits[request_id] = self.waits.get(request_id, 0) + 1
        if waited > CONTEXT_WAIT_STEPS:
            if waited == CONTEXT_WAIT_STEPS + 1:
                self.cache.stats.waits_given_up += 1
            return True
        self.cache.stats.wait_steps += 1
        counters: RequestCounters | None = self.scheduler.kv_request_counters.get(request_id)
        if counters is not None:
            counters.context_wait_steps += 1
        return False

    def settle(self) -> None:
        """After a schedule: the requests that took an entry and were scheduled hold its blocks
        (counted as hits); those that could not be (no room) give their claim back, as do
        compressing requests that were not scheduled."""
        scheduler, stats = self.scheduler, self.cache.stats
        for request_id, entry in self.taking.items():
            request = scheduler.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                counters: RequestCounters | None = scheduler.kv_request_counters.get(request_id)
                if entry.chain:
                    # held until the request's boundary eviction has run (``release_continued``): a
                    # turn preempted before then finds the same cache again
                    self.cache.hold(entry.key, request_id)
                    self.continuing[request_id] = entry.key
                    stats.chain_hits += 1
                    stats.chain_reused_tokens += entry.length
                    if counters is not None:
                        counters.chain_hits += 1
                        counters.chain_reused_tokens += entry.length
                    continue
                stats.hits += 1
                stats.blocks_shared += entry.block_count
                if counters is not None:
                    counters.context = "shared"
            else:
                scheduler.kv_ledger.evicted.pop(request_id, None)
        self.taking.clear()
        for request_id in self.chain_missed:
            request = scheduler.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                # a first turn, or a later one whose previous turn's entry was reclaimed (it compresses the
                # pristine history again): the run's records tell them apart by turn
                stats.chain_misses += 1
                counters: RequestCounters | None = scheduler.kv_request_counters.get(request_id)
                if counters is not None:
                    counters.chain_misses += 1
        self.chain_missed.clear()
        for request_id in list(self.compressing):
            request = scheduler.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                self.stop_compressing(request_id)

    def stop_compressing(self, request_id: str) -> None:
        key = self.compressing.pop(request_id, None)
        if key is not None and self.cache.owners.get(key) == request_id:
            del self.cache.owners[key]

    def publish_compressed(self) -> None:
        """Keep the contexts whose compression every group has reported (the worker wrote the kept
        blocks), under their keys; the requests that waited for them take them next."""
        scheduler = self.scheduler
        for request_id, key in list(self.compressing.items()):
            request = scheduler.requests.get(request_id)
            if request is None or request.is_finished():
                self.stop_compressing(request_id)
                continue
            length = scheduler.kv_request_settings[request_id].context_tokens
            if request.num_computed_tokens < length or any(
                    (request_id, g) in scheduler.kv_expected for g in range(scheduler.kv_groups)):
                continue
            self.stop_compressing(request_id)
            evicted = scheduler.kv_ledger.evicted.get(request_id)
            if not evicted or not any(evicted):
                continue  # nothing compressed (a policy that failed, or a context within its budgets)
            kept = tuple(length - count for count in evicted)
            managers = scheduler.kv_cache_manager.coordinator.single_type_managers
            blocks = tuple(manager.req_to_blocks[request_id][: cdiv(count, scheduler.kv_block_size)]
                           for manager, count in zip(managers, kept))
            self.cache.stats.misses += 1
            if self.cache.publish(key, request_id, length, kept, blocks):
                counters: RequestCounters | None = scheduler.kv_request_counters.get(request_id)
                if counters is not None:
                    counters.context = "compressed"

    def release_continued(self) -> None:
        """Called at the end of each plan. A chained turn whose boundary eviction this plan (or an
        earlier one) scheduled no longer needs the chain entry it took: its compaction writes blocks
        of its own (its copy targets, ``EvictionScheduler.copy_targets``) and the plan has already
        given the entry's blocks back from its block list (``_reshape``). It lets go of the entry,
        which is released at once (free, found again until reclaimed: ``release_idle``), so the turn
        holds the history once, its own compressed copy, and not the entry's beside it until it
        finishes. The blocks may be handed out from the next plan on: its step runs after this one,
        which reads them (one worker, steps in order: as ``_reshape``'s victims). An entry some
        request's blocks still include stays pinned (``release_idle``). A preemption from here on
        keeps the turn's own kept cache instead (``keep_preempted``)."""
        scheduler, released = self.scheduler, False
        for request_id, key in list(self.continuing.items()):
            request = scheduler.requests.get(request_id)
            if request is None or request.is_finished() or \
                    request.num_computed_tokens < scheduler.eviction_point(request):
                continue  # (finished: forget() drops it; before its boundary: it still reads the entry)
            self.cache.let_go(request_id, key)
            del self.continuing[request_id]
            released = True
        if released:
            self.cache.release_idle()

    def keep_preempted(self, request) -> None:
        """A chained request preempted once its boundary eviction is planned (it no longer holds the
        entry it took: ``release_continued``) leaves its own kept cache as a chain entry, held for
        it until it finishes, and its replay takes it (``take``): the replay has the K/V it had,
        however the pool reclaimed the entry it once took. Its block list is already the eviction's
        (the plan reshapes it; the worker writes it in that step, before any later step reads it), so
        an eviction whose report is still to come (asynchronous scheduling) is no reason to wait.
        Not counted as published (only finished turns are). One preempted before its boundary still
        holds the entry it took, and takes it again."""
        request_id = request.request_id
        if request_id in self.continuing or request_id in self.scheduler.kv_uncached:
            return
        key = self.publish_chain(request, counted=False, planned=True)
        if key is not None:
            self.cache.hold(key, request_id)
            self.resuming[request_id] = key

    def publish_chain(self, request, counted: bool = True, planned: bool = False) -> tuple | None:
        """A finished ``chain=true`` request that compressed (or continued a compressed cache)
        leaves its whole kept cache for the next turn: per group its first ``cdiv(kept, block)``
        blocks, standing for the logical tokens it computed (``prompt + output - 1``: the last
        output token's K/V is never computed). Called before vLLM frees its blocks (the entry's
        reference keeps them). Not after an error, nor with an eviction not yet settled.

        vLLM internals it rests on: a request's last sampled token is appended and the stop checked
        before its blocks are freed (``vllm/v1/core/sched/scheduler.py:2167, 2493-2510``, then
        ``_free_request`` at :2230 -> ``_free_blocks`` :2746 -> ``_free_request_blocks`` :2766, the
        scheduler's override), so its computed tokens are ``num_tokens - 1`` (under asynchronous
        scheduling one more may be counted for a step in flight, whose write lands past the kept
        slots: hence the ``min``); ``Request.block_hashes`` grow with its outputs
        (``vllm/v1/request.py:272-288``), so the key covers the answer; a KV connector's deferred free
        never applies (no sharing with one, ``EvictionScheduler._shares_contexts``; ``scheduler.py:2757-2775``)."""
        scheduler, request_id = self.scheduler, request.request_id
        settings = scheduler.kv_request_settings.get(request_id)
        if settings is None or not settings.chain or request.status == RequestStatus.FINISHED_ERROR:
            return None
        evicted = scheduler.kv_ledger.evicted.get(request_id)
        pending = [scheduler.kv_expected.get((request_id, g)) for g in range(scheduler.kv_groups)]
        # (``planned``: a compaction the plan reshaped the blocks for already counts; a block policy's
        # victim not yet named, or budgets not yet measured, do not)
        if not evicted or not any(evicted) or any(
                expected is not None and not (planned and getattr(expected, "kept", None) is not None)
                for expected in pending):
            return None
        length = min(request.num_computed_tokens, request.num_tokens - 1)
        if length < scheduler.eviction_point(request):
            return None  # ended before its boundary (an abort): the previous turn's entry still stands
        key = chain_entry_key(request, settings, length, scheduler.kv_cache_manager.block_pool.hash_block_size)
        if key is None:
            return None
        kept = tuple(length - count for count in evicted)
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        held = [manager.req_to_blocks.get(request_id, []) for manager in managers]
        if any(len(blocks) < cdiv(count, scheduler.kv_block_size) for blocks, count in zip(held, kept)):
            return None
        blocks = tuple(blocks[: cdiv(count, scheduler.kv_block_size)] for blocks, count in zip(held, kept))
        self.cache.publish(key, request_id, length, kept, blocks, counted)
        return key if key in self.cache.entries else None

    def forget(self, request, finished: bool) -> None:
        """A request lets go of its blocks (finished, aborted or preempted): what it was taking or
        compressing goes; a finished one's records go too."""
        request_id = request.request_id
        if finished:
            self.keys.pop(request_id, None)
            self.waits.pop(request_id, None)
            self.continuing.pop(request_id, None)
            own = self.resuming.pop(request_id, None)
            if own is not None and request.status == RequestStatus.FINISHED_ERROR:
                # its eviction, planned when it was preempted, failed in the worker: what it kept is not a cache
                self.cache.drop(own)
        self.taking.pop(request_id, None)
        self.stop_compressing(request_id)

"""Chained turns (``chain=true``) on the scheduler side (no model, no engine): the real
``EvictionScheduler`` on vLLM's ``Scheduler`` with prefix caching and a real block pool, and the
fake worker of ``test_async_scheduling`` (K/V written at the plan's physical slots, the harness's
own step driver evicting, vLLM's copy-on-write copies carried out before the step's writes).

Conversations of three turns, each turn's prompt the previous prompt, its answer and a new message,
its boundary the answer's end: every later turn takes the previous turn's chain entry (its blocks
are never written after they are published: checked after every step), computes only its new tokens
and compresses at its boundary; what each turn's request holds when it ends equals one contiguous
cache through which the same evictions ran turn by turn (the semantic oracle, the plain reference's,
is ``test_chain_references``); every block comes back. Under synchronous and asynchronous
scheduling, with an entry reclaimed in a small pool, and with two layer groups."""
from __future__ import annotations

import pytest
import torch

from harness.engine.backend_views import FlashAttnView
from harness.eviction.settings import CONFIG_KEY, group_policies, parse_settings
from harness.eviction.state import PolicyState
from harness.eviction.step import StepRequest, evict_step
from tests.unit.test_async_scheduling import BLOCK, DIM, HEADS, LAYERS, Worker, drive, kv, make_scheduler

PROMPT, CONTEXT, OUTPUTS, MESSAGE, TURNS = 37, 24, 6, 5, 3
CONVERSATIONS = 2


def settings_of(name: str, boundary: int, **extra) -> dict:
    return {"policy": name, "budget_ratio": 0.5, "decode_eviction": False, "compress": "context",
            "context_tokens": boundary, "chain": True, **extra}


def request_id(conversation: int, turn: int) -> str:
    return f"r{10 * (conversation + 1) + turn}"  # kv() reads the number after "r"


class CopyingWorker(Worker):
    """The fake worker, plus vLLM's copy-on-write of a partial prefix hit's last block (the worker
    copies it before the step's forward pass: gpu_model_runner.py:1199-1208, every layer of every
    group's storage: v1/worker/utils.py:909-950), and a check that no chain entry's kept slots ever
    change once published."""

    def __init__(self, pool: int, scheduler, groups: int = 1):
        super().__init__(pool, groups)
        self.scheduler = scheduler
        self.published: dict[tuple, list[torch.Tensor]] = {}
        self.copies = 0

    def step(self, output):
        for copy in output.kv_cache_block_copies or ():
            self.copies += 1
            for view in self.views:
                for cache in view.layers:
                    cache[copy.dst_block_id] = cache[copy.src_block_id].clone()
        return super().step(output)

    def entry_slots(self, entry) -> list[torch.Tensor]:
        held = []
        for group, (blocks, kept) in enumerate(zip(entry.blocks, entry.kept)):
            slots = [(blocks[slot // BLOCK].block_id, slot % BLOCK) for slot in range(kept)]
            held.append(torch.stack([torch.stack([cache[block, :, offset] for block, offset in slots])
                                     for cache in self.views[group].layers]))
        return held

    def check_entries(self) -> None:
        entries = self.scheduler.kv_contexts.entries
        for key in list(self.published):
            if key not in entries:  # reclaimed by the pool: its blocks may be anyone's now
                del self.published[key]
        for key, entry in entries.items():
            now = self.entry_slots(entry)
            if key not in self.published:
                self.published[key] = now
            for before, after in zip(self.published[key], now, strict=True):
                assert torch.equal(before, after), f"a kept block of entry {entry.owner}'s was written"


def drive_checking_entries(scheduler, worker: CopyingWorker, asynchronous: bool) -> None:
    """Every request to the end (``test_async_scheduling.drive``), checking the entries after every
    step."""
    drive(scheduler, worker, asynchronous, after_update=lambda queue: worker.check_entries())
    # the last finished requests' blocks reach the worker with the next schedule
    worker.step(scheduler.schedule())


class Oracle:
    """One contiguous cache per conversation through which the same evictions run, turn by turn:
    turn k writes its tokens from where turn k-1's cache ended (K/V as its own request writes them),
    evicts at its boundary by its own policy (the harness's step driver), then writes its question
    and all but its last output."""

    def __init__(self, groups: int):
        self.groups = groups
        self.views = [FlashAttnView([torch.zeros(128, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)])
                      for _ in range(groups)]
        self.blocks = [[] for _ in range(groups)]
        self.spare = [list(range(128)) for _ in range(groups)]
        self.length, self.evicted = 0, [0] * groups

    def write(self, rid: str, end: int) -> None:
        for group, view in enumerate(self.views):
            for position in range(self.length, end):
                slot = position - self.evicted[group]
                while len(self.blocks[group]) <= slot // BLOCK:
                    self.blocks[group].append(self.spare[group].pop(0))
                for layer, cache in enumerate(view.layers):
                    block = self.blocks[group][slot // BLOCK]
                    cache[block, :, slot % BLOCK] = kv(rid, position, group * LAYERS + layer)
        self.length = end

    def turn(self, rid: str, settings, prompt: int, boundary: int, outputs: int) -> list[torch.Tensor]:
        start = self.length
        self.write(rid, boundary)
        policies = group_policies(settings, BLOCK, LAYERS * self.groups, self.groups)
        changed = evict_step(self.views, [PolicyState() for _ in range(self.groups)],
                             [StepRequest(rid, policies, self.blocks, boundary, start, boundary, tuple(self.evicted))])
        for (_, group), eviction in changed.items():
            self.evicted[group] += eviction.evicted_tokens
        self.write(rid, prompt + outputs - 1)
        held = []
        for group in range(self.groups):
            blocks = self.blocks[group]
            slots = [(blocks[slot // BLOCK], slot % BLOCK) for slot in range(self.length - self.evicted[group])]
            held.append(torch.stack([torch.stack([cache[block, :, offset] for block, offset in slots])
                                     for cache in self.views[group].layers]))
        return held


def converse(name: str, asynchronous: bool = False, pool: int = 160, admit_whole: bool = True, groups: int = 1,
             extra: dict | None = None, conversations: int = CONVERSATIONS):
    """CONVERSATIONS conversations of TURNS turns, each turn of all of them at once; returns the
    worker, the scheduler and each turn's (request, settings, prompt, boundary)."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    from vllm.utils.hashing import get_hash_fn_by_name

    scheduler = make_scheduler(asynchronous, pool, admit_whole, groups, prefix_caching=True)
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    worker = CopyingWorker(pool, scheduler, groups)
    prompts = [[100 + c] * PROMPT for c in range(conversations)]
    boundaries = [CONTEXT] * conversations
    turns = []
    for turn in range(TURNS):
        for c in range(conversations):
            raw = settings_of(name, boundaries[c], **(extra or {}))
            params = SamplingParams(max_tokens=OUTPUTS, ignore_eos=True, extra_args={CONFIG_KEY: raw})
            rid = request_id(c, turn)
            scheduler.add_request(Request(rid, list(prompts[c]), params, None, block_hasher=hasher))
            turns.append((rid, parse_settings(raw, "test").for_prompt(len(prompts[c]), BLOCK), len(prompts[c]),
                          boundaries[c], c))
        drive_checking_entries(scheduler, worker, asynchronous)
        for c in range(conversations):
            boundaries[c] = len(prompts[c]) + OUTPUTS
            prompts[c] = prompts[c] + [5] * OUTPUTS + [200 + 10 * c + turn] * MESSAGE  # the answer: the worker's TOKEN
    return worker, scheduler, turns


def check_against_the_oracle(worker, turns, groups: int = 1) -> None:
    oracles = [Oracle(groups) for _ in range(1 + max(c for *_, c in turns))]
    for rid, settings, prompt, boundary, c in turns:
        expected = oracles[c].turn(rid, settings, prompt, boundary, OUTPUTS)
        for group in range(groups):
            assert torch.equal(worker.kept[rid][group], expected[group]), (rid, group)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["paged", "knorm", "streaming"])
def test_each_turn_continues_the_previous_turns_compressed_cache(name, asynchronous):
    worker, scheduler, turns = converse(name, asynchronous)
    stats = scheduler.kv_contexts.stats
    later = CONVERSATIONS * (TURNS - 1)
    assert stats.chain_hits == later and stats.chain_published == CONVERSATIONS * TURNS
    # a turn computed its new tokens only: the previous turn's prompt and all but its last output were hit
    assert stats.chain_reused_tokens == sum(prompt + OUTPUTS - 1 for _, _, prompt, _, _ in turns[:later])
    assert scheduler.kv_ledger.totals.counts()["evictions"]["prefill"] == CONVERSATIONS * TURNS  # one per turn
    # every chain entry taken ends mid-block here (its kept budget, whole blocks, then the question and all
    # but the last answer token: 30 tokens in 4-token blocks): every hit copies its partial last block
    # (vLLM's copy-on-write), whatever the policy
    assert worker.copies == later
    check_against_the_oracle(worker, turns)
    # every block back: the entries no request holds count as free (found again until reclaimed)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 160 - 1
    assert not scheduler.kv_contexts.holders and not scheduler.kv_contexts.pinned


def test_a_request_counts_its_chain_hit_and_the_tokens_it_did_not_compute():
    _, scheduler, turns = converse("paged")
    counters = {rid: scheduler.kv_request_counters[rid].as_dict() for rid, *_ in turns}
    first, second = request_id(0, 0), request_id(0, 1)
    assert "chain_hits" not in counters[first]
    assert (counters[second]["chain_hits"], counters[second]["chain_reused_tokens"]) == (1, PROMPT + OUTPUTS - 1)
    assert scheduler.kv_ledger.snapshot()["shared_contexts"]["chain_hits"] == CONVERSATIONS * (TURNS - 1)


# (Preemption of a chained turn, before and after its boundary eviction, and with its eviction in flight:
# tests/unit/test_shared_contexts.py, where vLLM's own _preempt_request is called at the moment wanted. In
# this shape no pool preempts a turn after its eviction while every entry a later turn needs survives:
# a turn lets go of its entry once its eviction is planned, and free entries are reclaimed before vLLM
# preempts anything.)


def test_a_turn_whose_entry_the_pool_reclaimed_recompresses_and_counts_a_miss():
    """Entries no request holds are reclaimed least recently used when the pool needs blocks (as
    vLLM's prefix cache is): a later turn whose entry is gone compresses its pristine history again,
    and is counted as a chain miss (the first turns are the others)."""
    _, scheduler, turns = converse("knorm", pool=40, admit_whole=False, conversations=3)
    later_misses = [rid for rid, *_ in turns[3:] if scheduler.kv_request_counters[rid].chain_hits == 0]
    assert later_misses, "the pool reclaimed no entry a later turn needed: make it smaller"
    assert all(scheduler.kv_request_counters[rid].chain_misses == 1 for rid in later_misses)
    assert scheduler.kv_contexts.stats.chain_misses == 3 + len(later_misses)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 40 - 1


def test_two_layer_groups_chain_each_group_by_its_own_counts():
    worker, scheduler, turns = converse("paged", groups=2, extra={"budget_schedule": "pyramid"})
    assert scheduler.kv_contexts.stats.chain_hits == CONVERSATIONS * (TURNS - 1)
    check_against_the_oracle(worker, turns, groups=2)


def test_batch_runs_conversations_build_each_turn_from_the_last_prompt_answer_and_message():
    """``harness.engine.batch_run``'s conversations (what the engine test runs), on a stand-in engine:
    a later turn's prompt is the previous prompt, its output and the message; its boundary the
    output's end; every request gets its conversation's settings at its own boundary."""
    from types import SimpleNamespace

    from harness.engine.batch_run import run_conversations

    class Engine:
        def __init__(self):
            self.asked = []

        def generate(self, prompts, lengths, settings, **_):
            self.asked.append((prompts, lengths, settings))
            return [SimpleNamespace(token_ids=[len(p) % 7, 1], top_logprobs=[], request_id=f"q{len(self.asked)}-{i}")
                    for i, p in enumerate(prompts)]

        def request_counters(self, ids):
            return {rid: {"id": rid} for rid in ids}

        def ledger(self, reset=False):
            return {}

        def free_blocks(self):
            return 0

    engine = Engine()
    chain = {"policy": "paged", "budget": None, "budget_ratio": 0.5, "compress": "context", "chain": True}
    run = run_conversations(engine, [{"prompt": [1, 2, 3, 4], "context_tokens": 2, "messages": [[8], [9, 9]],
                                      "eviction": chain, "max_new_tokens": 2},
                                     {"prompt": [5, 6], "context_tokens": 1, "messages": [], "eviction": chain,
                                      "max_new_tokens": 3}], True, 0, in_process=False)
    assert run["prompts"] == [[[1, 2, 3, 4], [1, 2, 3, 4, 4, 1, 8], [1, 2, 3, 4, 4, 1, 8, 0, 1, 9, 9]], [[5, 6]]]
    assert run["boundaries"] == [[2, 6, 9], [1]]
    assert [len(turn[0]) for turn in engine.asked] == [2, 1, 1] and engine.asked[0][1] == [2, 3]
    assert engine.asked[2][2] == [{"kv_eviction": {**chain, "context_tokens": 9}}]
    assert run["chain_blocks"] is None and run["request_counters"][0][1] == {"id": "q2-0"}

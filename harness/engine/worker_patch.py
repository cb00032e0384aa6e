"""Worker side of eviction (model runner): physical inputs, and the evictions themselves.

* When the KV cache is initialised, an engine configured to evict checks what it is about to
  read: the attention backend by exact name, its kernels and the cache dtype (``kv_view``), the
  scheduler hook and engine features (``harness.engine.compatibility.check_compatible``). A run it cannot serve stops
  at start, not at its first eviction.
* After vLLM prepares a step's inputs, attention ``seq_lens`` / ``max_seq_len`` and the slot
  mapping become physical (logical minus the request's evicted tokens, from the scheduler's
  ``EvictionPlan``). RoPE positions, input-id gathering and the sampled-token discard mask stay
  logical. With several KV cache groups (``engine.layer_groups``) each group has its own evicted
  count: its own slot mapping, and, where the groups' counts differ, its own ``seq_lens``, handed
  to its attention metadata builder (``GroupLengths``).
* For requests whose policy reads attention, the step's query rows are planned here and copied
  by hooks on the attention layers as the model runs (``query_capture``), then added to each
  request's window once the step is done. A request at the attention schedule has its prompt's
  last queries copied the same way, apart, and in the step that reaches its eviction point its
  layer groups' budgets are measured from them (``harness.eviction.layer_budgets``): that step's
  eviction follows them, and the report tells the scheduler. A request at the kvzip schedule has
  them measured, in the same step, from the reconstruction scores its passes leave
  (``reconstruct_due``), reported the same way.
* After a step has written its K/V and sampled, a request whose policy sums attention (H2O) has
  its uncounted queries counted when the prompt completes or its window is all uncounted; the
  requests of the plan whose prompt just completed past their budget, or whose newest block just
  filled past it, go to the evictor together (``evict_all``), each with its own policy (and the
  copy targets the scheduler allocated under prefix caching); their block lists and rows in the
  persistent block table take their new shape, and the step's ``EvictionReport`` tells the
  scheduler, which returns the released blocks to the pool.

vLLM offers no hook around input preparation or after sampling, so four runner methods and the
attention groups' ``build_metadata`` are wrapped; the wrappers are made here (``wrap_*``) and
installed, with every other patch, by ``harness.engine.patches``, through whose helpers this
module also sets its state on the runner and its attention groups (each attribute listed there).
``CPUModelRunner`` subclasses ``GPUModelRunner``: one patch serves CPU and GPU (the V1 runner; vLLM
0.32's Model Runner V2 builds positions and seq_lens in one Triton kernel and is refused, see
``settings``).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import logging

import numpy as np
import torch

from harness.eviction.evictor import PolicyFailure
from harness.eviction.step import StepRequest, evict_step
from harness.eviction.shards import SINGLE, HeadShards
from harness.eviction.state import PolicyState
from harness.eviction.kv_view import KVView
from harness.engine import patches
from harness.engine.backend_views import UnsupportedLayoutError, make_view
from harness.engine.query_capture import QueryCapture
from harness.engine.layer_groups import acting_policy, policies_by_group
from harness.engine.reconstruction import Done, Reconstruction
from harness.eviction.messages import (
    PLAN_ATTRIBUTE, REPORT_ATTRIBUTE, EvictionNotActiveError, EvictionReport,
)
from harness.eviction.layer_budgets import kvzip_measured_settings, measured_settings, spread_and_shift
from harness.eviction.settings import CONFIG_KEY, EvictionSettings, settings_from
from harness.engine.compatibility import SCHEDULER_CLS, check_compatible
from policies import Policy
from policies.budget_schedules import ATTENTION_WINDOW


logger = logging.getLogger(__name__)


class WorkerEviction:
    """A runner's default eviction settings, its policies (per distinct settings a request
    brought, one per KV cache group) and a view of each group's layers of its KV cache."""

    def __init__(self, runner, settings: EvictionSettings | None):
        self.settings = settings
        self.block_size = runner.cache_config.block_size
        self.policies: dict[tuple, tuple[Policy, ...]] = {}
        self.backend = self.capture = self.reconstruction = None
        self.views: list[KVView] = []
        self.group_layers: list[list[int]] = []
        self.unsupported = None  # why this runner cannot evict, if it cannot
        self.groups = max(1, len(runner.attn_groups))
        # each KV cache group's spec and layer count (a hybrid model's sliding-window groups never evict)
        self.group_specs = [(groups[0].kv_cache_spec, len(groups[0].layer_names)) for groups in runner.attn_groups]
        # Per group: each request's policy state (cached scores, totals, query windows), and the
        # prompt windows of requests whose attention schedule is still to be measured.
        self.policy_states = [PolicyState() for _ in range(self.groups)]
        self.schedule_states = [PolicyState() for _ in range(self.groups)]
        # Settings with the group budgets this worker measured, until the scheduler's plan carries them.
        self.measured: dict[str, EvictionSettings] = {}
        self.lengths = GroupLengths(runner) if self.groups > 1 else None
        self.shards = SINGLE
        self.enforce_eager = runner.model_config.enforce_eager
        self.async_scheduling = bool(runner.vllm_config.scheduler_config.async_scheduling)
        self.compiled_cuda = runner.device.type == "cuda" and not self.enforce_eager
        # This rank's own seconds (the scheduler sees rank 0's reports only): model steps that
        # evicted or captured, evictions, query capture; read through the worker extension.
        self.seconds = {"model_s": 0.0, "evict_s": 0.0, "capture_s": 0.0, "reconstruct_s": 0.0}
        try:
            check_compatible(runner.vllm_config)
            self.backend, self.views, self.group_layers = kv_views_of(runner, self.block_size)
            self.shards = head_shards(runner, self.views[0].num_heads)
            self.capture = QueryCapture(runner, attention_layers(runner))
            self.reconstruction = Reconstruction(runner, self.capture.modules, self.capture.scales, self.views,
                                                 self.group_layers, self.shards)
            for states in (self.policy_states, self.schedule_states):
                for policy_state, layers in zip(states, self.group_layers):
                    policy_state.scales = [self.capture.scales[layer] for layer in layers]
        except (ValueError, UnsupportedLayoutError) as error:
            if settings is not None:
                raise
            self.unsupported = str(error)
        if settings is not None:
            self.policy_for(settings)
        self.device = runner.device

    def policy_for(self, settings: EvictionSettings) -> tuple[Policy, ...]:
        """The settings' policy in each KV cache group (each its own share of the budget)."""
        policies = self.policies.get(settings.key)
        if policies is None:
            policies = policies_by_group(settings, self.block_size, self.group_specs, enforce_eager=self.enforce_eager,
                                         async_scheduling=self.async_scheduling)
            if len({policy.budget for policy in policies}) > 1 and self.compiled_cuda:
                # Full CUDA graphs replay the seq_lens buffer they captured (layer_groups_verification.md
                # B5.6); a group's own lengths would not reach them.
                raise EvictionNotActiveError(f"budget_schedule={settings.budget_schedule} gives the layer groups "
                                             "different lengths, which CUDA graphs do not follow: run with enforce_eager")
            if len({policy.evicts for policy in policies}) > 1 and self.compiled_cuda:
                # the same on a hybrid model: its global group's lengths are not its sliding-window groups'
                raise EvictionNotActiveError(f"{settings.describe()} on a model with sliding-window layers gives its "
                                             "global layers their own lengths, which CUDA graphs do not follow: run "
                                             "with enforce_eager")
            if (acting_policy(policies).query_window or acting_policy(policies).reconstructs
                    or settings.budget_schedule == "attention") \
                    and self.capture is not None and self.capture.unsupported:
                raise EvictionNotActiveError(f"{settings.describe()} cannot run on this engine: {self.capture.unsupported}")
            self.policies[settings.key] = policies
        return policies

    def settings_of(self, request_id: str, settings: EvictionSettings) -> EvictionSettings:
        """A request's settings as this step runs them: the plan's, or, for an attention schedule
        measured here whose budgets the plan does not carry yet, the measured ones."""
        if not settings.measuring:
            self.measured.pop(request_id, None)
            return settings
        return self.measured.get(request_id, settings)
    def synchronize(self) -> None:
        """Timings of GPU work mean something only once the queued kernels have run."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def kv_views_of(runner, block_size: int) -> tuple[str, list[KVView], list[list[int]]]:
    """The attention backend's exact name, a view, through it, of each KV cache group's layers
    of the runner's KV cache (one group, or ``engine.layer_groups`` of contiguous layers), and
    each group's layers as positions in layer order. A block
    id means a slot in its own group's layers only: the groups' tensors alias one buffer
    (layer_groups_verification.md A5), so a view must never mix them."""
    groups = runner.attn_groups
    if any(len(attention_groups) != 1 for attention_groups in groups):
        raise ValueError(f"KV eviction supports one attention group per KV cache group; this model has "
                         f"{[len(attention_groups) for attention_groups in groups]}")
    position = {name: index for index, name in enumerate(layer_names_in_order(runner))}
    context = runner.compilation_config.static_forward_context
    backend, views, group_layers = None, [], []
    for attention_groups in groups:
        group = attention_groups[0]
        if group.kernel_block_size not in (None, block_size):
            raise ValueError("KV eviction needs kernel blocks equal to the KV manager's blocks")
        # CPU_ATTN's metadata builder sets ``layer.isa`` on every attention layer
        # (vllm/v1/attention/backends/cpu_attn.py:169-176); other backends have none.
        isa = getattr(context[group.layer_names[0]], "isa", None)
        backend = group.backend.get_name()
        layers = sorted(position[name] for name in group.layer_names)
        views.append(make_view(backend, [runner.kv_caches[index] for index in layers], isa))
        group_layers.append(layers)
    return backend, views, group_layers


def head_shards(runner, local_heads: int) -> HeadShards:
    """This worker's rank among the tensor-parallel workers, with vLLM's group to gather scores
    through (``GroupCoordinator.all_gather``, vllm/distributed/parallel_state.py:752-771: on CPU a
    shared-memory all-gather, vllm/distributed/device_communicators/cpu_communicator.py:120-146;
    on GPU the device communicator's, NCCL)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group

    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return SINGLE
    total = runner.model_config.get_total_num_kv_heads()
    if local_heads * size != total:
        # vLLM replicates KV heads when there are fewer than ranks (vllm/model_executor/layers/linear.py,
        # QKVParallelLinear): ranks would hold the same heads and evict them twice over.
        raise ValueError(f"KV eviction under tensor parallelism needs the {total} KV heads split evenly over "
                         f"{size} ranks; this rank holds {local_heads}")
    group = get_tp_group()

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        # Bytes are gathered as float32 (what the CPU shared-memory all-gather surely supports);
        # an int64 digest travels as its bit pattern.
        if tensor.dtype == torch.float32:
            return group.all_gather(tensor, dim=0)
        gathered = group.all_gather(tensor.view(torch.float32).reshape(tensor.shape[0], -1), dim=0)
        return gathered.view(tensor.dtype).reshape(-1, *tensor.shape[1:])

    return HeadShards(get_tensor_model_parallel_rank(), size, all_gather)


def layer_names_in_order(runner) -> list[str]:
    """Every KV cache group's attention layers in the order of ``runner.kv_caches`` (sorted by
    layer index, ``vllm/v1/worker/utils.py:844-858``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted((name for groups in runner.attn_groups for name in groups[0].layer_names), key=extract_layer_index)


def attention_layers(runner) -> list:
    """The attention modules in the order of ``runner.kv_caches``, so window layer i is view layer i."""
    context = runner.compilation_config.static_forward_context
    return [context[name] for name in layer_names_in_order(runner)]


def attach_eviction_state(runner) -> None:
    """Called once the KV cache exists. An engine whose default evicts is checked here and
    refused if it cannot; otherwise requests may still ask for eviction one by one."""
    patches.set_on(runner, "_kv_eviction", WorkerEviction(runner, settings_from(runner.vllm_config)))


def eviction_state(runner) -> WorkerEviction | None:
    return runner.__dict__.get("_kv_eviction")


def asks_for_eviction(state: WorkerEviction, scheduler_output) -> bool:
    """Whether this step needs the scheduler's plan: the engine evicts by default, or a request
    that just arrived asks to."""
    if state.settings is not None:
        return True
    return any(
        CONFIG_KEY in ((new.sampling_params.extra_args or {}) if new.sampling_params else {})
        for new in scheduler_output.scheduled_new_reqs
    )


def to_physical(runner, state: WorkerEviction, scheduler_output) -> None:
    """Make this step's attention lengths and KV write slots physical."""
    plan = scheduler_output.__dict__.get(PLAN_ATTRIBUTE)
    if plan is None:
        if asks_for_eviction(state, scheduler_output):
            raise EvictionNotActiveError(
                "KV eviction is asked for but the scheduler sent no eviction message this step: vLLM's own "
                f"scheduler is running; pass --scheduler-cls {SCHEDULER_CLS}")
        return
    if plan.default != state.settings:
        raise EvictionNotActiveError(
            f"the scheduler's default eviction is {plan.default} but this worker was configured with {state.settings}")
    if plan.settings and state.unsupported is not None:
        raise EvictionNotActiveError(f"a request asks for KV eviction but this worker cannot evict: {state.unsupported}")
    for policy_state in state.policy_states + state.schedule_states:
        policy_state.forget(plan.released)
    for request_id in plan.released:
        state.measured.pop(request_id, None)
    evicted = plan.evicted_tokens
    if not evicted:
        return
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    counts = np.zeros((num_reqs, state.groups), dtype=np.int64)  # per request, per KV cache group
    for row, rid in enumerate(batch.req_ids[:num_reqs]):
        counts[row] = evicted.get(rid, 0)
    if not counts.any():
        return
    # The common lengths are the longest group's (max_seq_len stays an upper bound, backend.py:408-409);
    # a group that evicted more gets its own below.
    common = torch.from_numpy(counts.min(axis=1))
    runner.optimistic_seq_lens_cpu[:num_reqs] -= common.to(runner.optimistic_seq_lens_cpu.dtype)
    runner.seq_lens[:num_reqs] -= common.to(runner.seq_lens.device, runner.seq_lens.dtype)
    total = scheduler_output.total_num_scheduled_tokens
    request_of_token = runner.req_indices.gpu[:total].long()
    query_start = runner.query_start_loc.gpu[: num_reqs + 1]
    if state.groups == 1:
        shift = common.to(runner.positions.device)[request_of_token].to(runner.positions.dtype)
        batch.block_table.compute_slot_mapping(num_reqs, query_start, runner.positions[:total] - shift)
        return
    for group in range(state.groups):
        own = torch.from_numpy(counts[:, group])
        shift = own.to(runner.positions.device)[request_of_token].to(runner.positions.dtype)
        # each group's slots from its own physical positions (vLLM computes every group's from the
        # same positions: block_table.py:283-290, called at gpu_model_runner.py:2144-2148)
        batch.block_table[group].compute_slot_mapping(num_reqs, query_start, runner.positions[:total] - shift)
        if (own != common).any():
            state.lengths.set(group, (own - common).to(runner.seq_lens.device, runner.seq_lens.dtype), num_reqs)


class GroupLengths:
    """Each KV cache group's own attention ``seq_lens`` for the step being run, where its evicted
    count differs from the common one: vLLM builds one ``CommonAttentionMetadata`` with one
    ``seq_lens`` and copies it per group, replacing only block table and slot mapping
    (``gpu_model_runner.py:2397-2413``, ``:2517-2530``); both kernels take ``seq_lens`` per call
    (``cpu_attn.py:446``, ``flash_attn.py:1277``) and both builders derive their work split from it
    inside ``build`` (``cpu_attn.py:244-258``, ``flash_attn.py:934-944``), so a group's lengths are
    substituted before its builder runs (``AttentionGroup.build_metadata``, wrapped in
    ``install``). Set by ``to_physical`` after ``_prepare_inputs``, cleared when the step's
    ``execute_model`` returns, so dummy and capture runs see the common lengths."""

    def __init__(self, runner):
        self.runner = runner
        self.buffers: dict[int, torch.Tensor] = {}
        self.active: dict[int, torch.Tensor] = {}
        for group, attention_groups in enumerate(runner.attn_groups):
            for attention_group in attention_groups:
                # a plain dataclass without slots (vllm/v1/worker/utils.py:261-262): its KV cache
                # group rides on it for the wrapped build_metadata, which is not told the group
                patches.set_on(attention_group, "_kv_group_lengths", (self, group))

    def set(self, group: int, extra: torch.Tensor, num_reqs: int) -> None:
        """The group's lengths: the common ones minus the group's ``extra`` evicted tokens per request."""
        buffer = self.buffers.get(group)
        if buffer is None:
            buffer = self.buffers[group] = torch.empty_like(self.runner.seq_lens)
        buffer.copy_(self.runner.seq_lens)
        buffer[:num_reqs] -= extra
        self.active[group] = buffer

    def clear(self) -> None:
        self.active.clear()

    def substitute(self, group: int, metadata):
        lengths = self.active.get(group)
        if lengths is None:
            return metadata
        common = metadata.seq_lens
        if common.data_ptr() != self.runner.seq_lens.data_ptr():
            # a micro-batch's slice (vllm/v1/worker/ubatch_utils.py:333): not the step's whole batch
            raise EvictionNotActiveError("layer groups with different budgets cannot run with micro-batching (DBO)")
        # a copy with the group's lengths (vLLM's own dataclasses.replace: vllm/v1/attention/backend.py:483-484)
        return metadata.replace(seq_lens=lengths[: common.shape[0]])


def plan_capture(runner, state: WorkerEviction, scheduler_output) -> None:
    """Which query rows of this step the attention hooks copy: the newest ``query_window`` of each
    scheduled request whose policy reads attention (its rows, ``query_start_loc``, are final once
    vLLM has prepared the inputs: ``vllm/v1/worker/gpu_model_runner.py:2029-2030``), and the newest
    ``ATTENTION_WINDOW`` of each request prefilling towards an attention schedule's measurement."""
    if state.capture is None:
        return
    plan = scheduler_output.__dict__.get(PLAN_ATTRIBUTE)
    wanted = []
    if plan is not None:
        batch = runner.input_batch
        starts = runner.query_start_loc.np
        for request_id, settings in plan.settings.items():
            settings = state.settings_of(request_id, settings)
            size = acting_policy(state.policy_for(settings)).query_window
            row = batch.req_id_to_index.get(request_id)
            if row is None:
                continue
            if size:
                wanted.append((request_id, int(starts[row]), int(starts[row + 1]), size, 0))
            request = runner.requests.get(request_id)
            if settings.measuring and settings.budget_schedule == "attention" and request is not None and \
                    request.num_computed_tokens < settings.eviction_point(request.num_prompt_tokens):
                wanted.append((request_id, int(starts[row]), int(starts[row + 1]), ATTENTION_WINDOW, 1))
    state.capture.plan(wanted, runner.device)


def measure_schedules(runner, state: WorkerEviction, scheduler_output) -> dict[str, tuple[int, ...]]:
    """The group budgets of each request at the attention schedule whose prefill reached its
    eviction point this step, measured from its window and its cache (nothing evicted yet): kept
    for this step's eviction and until the plan carries them; returned for the report."""
    plan = scheduler_output.__dict__.get(PLAN_ATTRIBUTE)
    budgets = {}
    for request_id, settings in plan.settings.items():
        request = runner.requests.get(request_id)
        settings = state.settings_of(request_id, settings)
        if not settings.measuring or settings.budget_schedule != "attention" or request is None:
            continue  # (the kvzip schedule is measured from the passes' scores: reconstruct_due)
        before = request.num_computed_tokens
        after = before + scheduler_output.num_scheduled_tokens[request_id]
        if not before < settings.eviction_point(request.num_prompt_tokens) <= after:
            continue
        parts = []
        for group, schedule_state in enumerate(state.schedule_states):
            window = schedule_state.windows.get(request_id)
            if window is None or not window.filled:
                raise RuntimeError(f"request {request_id}: no prompt queries were captured to measure its attention schedule")
            parts.append(spread_and_shift(state.views[group], request.block_ids[group], after, window.queries,
                                          schedule_state.scales))
            schedule_state.forget([request_id])
        measured = state.measured[request_id] = measured_settings(settings, parts, state.block_size, state.shards,
                                                                  state.device)
        budgets[request_id] = measured.group_budgets
    return budgets


def reconstruct_due(runner, state: WorkerEviction, scheduler_output, failures: dict[str, PolicyFailure],
                    budgets: dict[str, tuple[int, ...]] | None = None) -> Done:
    """A reconstructing policy's passes (KVzip, ``harness.engine.reconstruction``) for each request
    whose prefill reached its eviction point this step, before the step's evictions read their
    scores. A request whose passes fail goes to ``failures`` (the scheduler ends it; the others run).

    A request at the kvzip schedule, not measured yet, has its group budgets measured here from
    every group's scores (``harness.eviction.layer_budgets.kvzip_measured_settings``): kept for this
    step's eviction and until the plan carries them (``state.measured``), and put in ``budgets``
    for the report, as ``measure_schedules`` does for the attention schedule; a group its budget
    leaves whole keeps no scores. Where the uniform budget holds the whole context no pass runs and
    the budgets are the equal shares'."""
    plan = scheduler_output.__dict__.get(PLAN_ATTRIBUTE)
    budgets = {} if budgets is None else budgets
    done = Done()
    if plan is None or state.reconstruction is None:
        return done
    # No score kept from before a prefix-cache reset is read (vLLM tells the scheduler only:
    # vllm/v1/engine/core.py:871-876; the plan counts them)
    state.reconstruction.forget_before(plan.prefix_cache_resets)
    for request_id, settings in plan.settings.items():
        request = runner.requests.get(request_id)
        if request is None:
            continue
        settings = state.settings_of(request_id, settings)
        policies = state.policy_for(settings)
        if not acting_policy(policies).reconstructs:  # (a hybrid model's group 0 may be a window's)
            continue
        before = request.num_computed_tokens  # (before this step: vLLM updates it at the next one)
        after = before + scheduler_output.num_scheduled_tokens[request_id]
        evicted = plan.evicted_tokens.get(request_id, (0,) * state.groups)
        point = settings.eviction_point(len(request.prompt_token_ids))
        due = state.reconstruction.due(policies, point, before, after, evicted)
        # the kvzip schedule in its measuring step (until then every group runs the uniform budget:
        # every group due, or none)
        measuring = settings.measuring and settings.budget_schedule == "kvzip" and before < point <= after
        if not any(due) and not measuring:
            continue
        ran = Done()
        try:
            if any(evicted):
                raise ValueError(f"it reconstructs the whole context, but {max(evicted)} of its tokens were evicted "
                                 "before its eviction point")
            if any(due):
                ran = state.reconstruction.run(request_id, request, settings, policies, state.policy_states, due,
                                               cache_salt=plan.cache_salts.get(request_id))
            if measuring:
                # (no pass ran: the uniform budget holds the whole context, so does every group's)
                scores = [each.scores[request_id] for each in state.policy_states] if any(due) else None
                measured = _measure_kvzip(state, request_id, settings, scores, point, budgets)
                kept = state.reconstruction.due(state.policy_for(measured), point, before, after, evicted)
                for policy_state, evicts in zip(state.policy_states, kept):
                    if not evicts:  # a group its budget leaves whole: nothing reads its scores
                        policy_state.scores.pop(request_id, None)
        except Exception as error:  # the request fails, not the step
            failures[request_id] = PolicyFailure(acting_policy(policies).name,
                                                 f"reconstruction: {type(error).__name__}: {error}")
            for policy_state in state.policy_states:
                policy_state.scores.pop(request_id, None)
            if measuring:
                state.measured.pop(request_id, None)
                budgets.pop(request_id, None)
            continue
        done.tokens += ran.tokens
        done.seconds += ran.seconds
        done.reused += ran.reused
    return done


def _measure_kvzip(state: WorkerEviction, request_id: str, settings: EvictionSettings, scores, point: int,
                   budgets: dict) -> EvictionSettings:
    layers = sum(len(layers) for layers in state.group_layers)
    measured = state.measured[request_id] = kvzip_measured_settings(settings, scores, state.block_size, point, layers,
                                                                    state.groups)
    budgets[request_id] = measured.group_budgets
    return measured


def evict_after_step(runner, state: WorkerEviction, scheduler_output, failures: dict[str, PolicyFailure]) -> dict:
    """Run the evictions this step calls for (``harness.eviction.step.evict_step``: each KV cache
    group on its own layers, block lists, counts and budgets, every request of a group together);
    returns ``{(request_id, group): Eviction}`` for those that changed something, each carrying an
    equal share of the step's eviction time (the batch has no per-request time). A request whose
    policy fails goes to ``failures`` and is evicted no further (the scheduler ends it)."""
    plan = scheduler_output.__dict__.get(PLAN_ATTRIBUTE)
    if plan is None or not plan.settings:
        return {}
    started = time.perf_counter()
    requests = []
    for request_id, settings in plan.settings.items():
        request = runner.requests.get(request_id)
        if request is None:
            continue
        settings = state.settings_of(request_id, settings)
        if settings.measuring:
            continue  # nothing to evict before its measurement
        before = request.num_computed_tokens
        requests.append(StepRequest(
            request_id, state.policy_for(settings), request.block_ids,
            settings.eviction_point(request.num_prompt_tokens),  # the prompt's end, or the context's
            before, before + scheduler_output.num_scheduled_tokens[request_id],
            plan.evicted_tokens.get(request_id, (0,) * state.groups),
            {group: plan.copy_targets[(request_id, group)] for group in range(state.groups)
             if (request_id, group) in plan.copy_targets}))
    changed = evict_step(state.views, state.policy_states, requests, state.shards, failures)
    if not changed:
        return {}
    state.synchronize()
    share = (time.perf_counter() - started) / len(changed)
    batch = runner.input_batch
    for request_id in {request_id for request_id, _ in changed}:
        row = batch.req_id_to_index.get(request_id)
        if row is not None:
            batch.block_table.add_row(runner.requests[request_id].block_ids, row)
    return {key: dataclasses.replace(eviction, seconds=share) for key, eviction in changed.items()}


# The runner's wrappers, each made from vLLM's own method (installed by ``harness.engine.patches``).

def wrap_initialize_kv_cache(original):
    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, *args, **kwargs):
        original(self, kv_cache_config, is_profiling, *args, **kwargs)
        if is_profiling:
            # A throw-away cache for CUDA-graph memory profiling (vllm/v1/worker/gpu_model_runner.py:6231,
            # freed by _cleanup_profiling_kv_cache): no view may keep it alive while the real
            # cache is allocated.
            patches.take_from(self, "_kv_eviction")
            return
        attach_eviction_state(self)

    return initialize_kv_cache


def wrap_prepare_inputs(original):
    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        state = eviction_state(self)
        if state is not None:
            to_physical(self, state, scheduler_output)
            plan_capture(self, state, scheduler_output)
        return result

    return _prepare_inputs


def wrap_execute_model(original):
    @functools.wraps(original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        patches.set_on(self, "_kv_step", (scheduler_output, time.perf_counter()))
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            state = eviction_state(self)
            if state is not None and state.lengths is not None:
                state.lengths.clear()  # this step's own lengths, built into its metadata by now

    return execute_model


def hold_unrewindable_generators(runner) -> dict:
    """Takes out of the batch, for this step's sampling, the seeded generators that vLLM would
    rewind and cannot: a request whose prefill is partial this step (its context boundary splits it,
    ``compress=context``; or a chunked prefill) samples a token that is discarded, and vLLM then
    rewinds its generator by ``set_offset`` (vllm/v1/worker/gpu_model_runner.py:3495-3502), which a
    CPU generator does not have: the worker raised and the engine stopped. Sampled without its
    generator, the discarded token leaves the generator where it was, as the rewind would (the
    sampler reads the batch's own dict: ``SamplingMetadata.generators``, gpu_input_batch.py:940);
    the caller puts them back. CUDA generators rewind as vLLM does."""
    batch = runner.input_batch
    discarded = runner.discard_request_mask.np[:batch.num_reqs].nonzero()[0]
    return {int(i): batch.generators.pop(int(i)) for i in discarded
            if int(i) in batch.generators and batch.generators[int(i)].device.type == "cpu"}


def wrap_sample_tokens(original):
    from vllm.v1.outputs import ModelRunnerOutput

    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        held = hold_unrewindable_generators(self)
        try:
            output = original(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)
        step = patches.take_from(self, "_kv_step")
        state = eviction_state(self)
        capture_s = (state.capture.absorb([state.policy_states, state.schedule_states], state.group_layers)
                     if state is not None and state.capture is not None else 0.0)
        # Under asynchronous scheduling the runner returns an AsyncGPUModelRunnerOutput wrapping the
        # ModelRunnerOutput that its get_output() hands to the engine (vllm/v1/worker/gpu_model_runner.py:281,
        # 344-365; pickled with its __dict__ by the multiprocess executor): the report rides on that.
        carrier = output if isinstance(output, ModelRunnerOutput) else getattr(output, "_model_runner_output", None)
        if state is None or step is None or not isinstance(carrier, ModelRunnerOutput) or not carrier.req_ids:
            return output
        scheduler_output, started = step
        plan = scheduler_output.__dict__.get(PLAN_ATTRIBUTE)
        if plan is None or not plan.settings:
            return output  # no request of this step evicts: nothing to time or report
        state.synchronize()
        evict_started = time.perf_counter()
        budgets = measure_schedules(self, state, scheduler_output)
        failures: dict[str, PolicyFailure] = {}
        reconstructed = reconstruct_due(self, state, scheduler_output, failures, budgets)  # timed within evict_s
        evictions = evict_after_step(self, state, scheduler_output, failures)
        for request_id, failure in failures.items():
            logger.warning("request %s ends with an error: %s", request_id, failure)
        state.synchronize()
        finished = time.perf_counter()
        report = EvictionReport(evictions, model_s=evict_started - started, evict_s=finished - evict_started,
                                capture_s=capture_s, budgets=budgets, reconstruct_s=reconstructed.seconds,
                                reconstruct_tokens=reconstructed.tokens, reconstruct_reused=reconstructed.reused,
                                failures={request_id: str(failure) for request_id, failure in failures.items()},
                                state_bytes=sum(each.nbytes() for each in state.policy_states + state.schedule_states))
        for key in state.seconds:  # this rank's own sums of the report's seconds
            state.seconds[key] += getattr(report, key)
        patches.set_on(carrier, REPORT_ATTRIBUTE, report)
        return output

    return sample_tokens


def wrap_build_metadata(original):
    @functools.wraps(original)
    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        owner = self.__dict__.get("_kv_group_lengths")
        if owner is not None:
            lengths, group = owner
            common_attn_metadata = lengths.substitute(group, common_attn_metadata)
        return original(self, common_attn_metadata, *args, **kwargs)

    return build_metadata

"""Worker side of eviction (model runner): physical inputs, and the evictions themselves.

* After vLLM prepares a step's inputs, attention ``seq_lens`` / ``max_seq_len`` and the slot
  mapping become physical (logical minus the request's evicted tokens, as the scheduler sent it).
  RoPE positions, input-id gathering and the sampled-token discard mask stay logical.
* After a step has written its K/V and sampled, each request whose prompt just completed past the
  budget, or whose newest block just filled past it, is handed to the evictor; the request's block
  list and its row in the persistent block table lose the emptied blocks, and the step's output
  tells the scheduler which blocks to return to the pool.

``CPUModelRunner`` subclasses ``GPUModelRunner``: one patch serves CPU and GPU (the V1 runner;
vLLM 0.32's Model Runner V2 builds positions and seq_lens in one Triton kernel and is not used
when eviction is on, see ``harness.engine.llm``).
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from harness.engine.evictor import evict, phase_due
from harness.engine.kv_view import KVView, make_view
from harness.engine.settings import build_policy, settings_from


class WorkerEviction:
    """A runner's eviction state: its policy and, once the KV cache exists, a view of it."""

    def __init__(self, runner, policy):
        self.runner = runner
        self.policy = policy
        self._view: KVView | None = None

    @property
    def view(self) -> KVView:
        if self._view is None:
            groups = self.runner.attn_groups
            group = groups[0][0]
            if group.kernel_block_size not in (None, self.policy.block_size):
                raise RuntimeError("eviction needs kernel blocks equal to KV manager blocks")
            context = self.runner.compilation_config.static_forward_context
            isa = getattr(context[group.layer_names[0]], "isa", None)
            self._view = make_view(group.backend.get_name(), list(self.runner.kv_caches), isa)
        return self._view


def eviction_state(runner) -> WorkerEviction | None:
    if not hasattr(runner, "_kv_eviction"):
        settings = settings_from(runner.vllm_config)
        runner._kv_eviction = (
            WorkerEviction(runner, build_policy(settings, runner.cache_config.block_size)) if settings else None
        )
    return runner._kv_eviction


def to_physical(runner, scheduler_output) -> None:
    """Make this step's attention lengths and KV write slots physical."""
    evicted = getattr(scheduler_output, "kv_evicted_tokens", None)
    if not evicted:
        return
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    counts = np.array([evicted.get(rid, 0) for rid in batch.req_ids[:num_reqs]], dtype=np.int64)
    if not counts.any():
        return
    counts_cpu = torch.from_numpy(counts)
    runner.optimistic_seq_lens_cpu[:num_reqs] -= counts_cpu.to(runner.optimistic_seq_lens_cpu.dtype)
    device_counts = counts_cpu.to(runner.seq_lens.device)
    runner.seq_lens[:num_reqs] -= device_counts.to(runner.seq_lens.dtype)
    total = scheduler_output.total_num_scheduled_tokens
    request_of_token = runner.req_indices.gpu[:total].long()
    physical_positions = runner.positions[:total] - device_counts[request_of_token].to(runner.positions.dtype)
    batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], physical_positions)


def evict_after_step(runner, state: WorkerEviction, scheduler_output) -> dict:
    """Run the evictions this step calls for; returns ``{request_id: Eviction}``."""
    evicted = getattr(scheduler_output, "kv_evicted_tokens", None) or {}
    batch = runner.input_batch
    report = {}
    for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
        request = runner.requests.get(request_id)
        if request is None:
            continue
        before = request.num_computed_tokens
        phase = phase_due(state.policy, request.num_prompt_tokens, before, before + scheduled, evicted.get(request_id, 0))
        if phase is None:
            continue
        block_ids = request.block_ids[0]
        physical = before + scheduled - evicted.get(request_id, 0)
        eviction = evict(state.policy, state.view, block_ids, physical, phase)
        if not eviction.evicted_tokens:
            continue
        for position in sorted(eviction.dropped_blocks, reverse=True):
            del block_ids[position]
        row = batch.req_id_to_index.get(request_id)
        if row is not None:
            batch.block_table.add_row(request.block_ids, row)
        report[request_id] = eviction
    return report


def install() -> None:
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_kv_eviction_installed", False):
        return
    GPUModelRunner._kv_eviction_installed = True

    original_prepare = GPUModelRunner._prepare_inputs

    @functools.wraps(original_prepare)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = original_prepare(self, scheduler_output, *args, **kwargs)
        if eviction_state(self) is not None:
            to_physical(self, scheduler_output)
        return result

    original_execute = GPUModelRunner.execute_model

    @functools.wraps(original_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        started = time.perf_counter()
        self._kv_step = (scheduler_output, started)
        return original_execute(self, scheduler_output, *args, **kwargs)

    original_sample = GPUModelRunner.sample_tokens

    @functools.wraps(original_sample)
    def sample_tokens(self, *args, **kwargs):
        output = original_sample(self, *args, **kwargs)
        step = getattr(self, "_kv_step", None)
        self._kv_step = None
        if step is None or not isinstance(output, ModelRunnerOutput) or not output.req_ids:
            return output
        scheduler_output, started = step
        evict_started = time.perf_counter()
        state = eviction_state(self)
        if state is not None:
            report = evict_after_step(self, state, scheduler_output)
            if report:
                output.kv_evictions = report
        finished = time.perf_counter()
        output.kv_model_s = evict_started - started
        output.kv_evict_s = finished - evict_started
        return output

    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner.sample_tokens = sample_tokens

"""The observation window: each request's newest queries, captured as vLLM's attention layers run.

vLLM's ``Attention.forward(query, key, value)`` (``vllm/model_executor/layers/attention/
attention.py:488``) receives a step's queries after the model applied RoPE, ``[tokens,
num_heads * head_size]`` with the requests' tokens one after the other in batch order
(``query_start_loc``). A forward pre-hook, torch's own module hook, on each attention layer copies
the rows of the requests whose policy reads attention, the newest ``query_window`` of each (and,
apart, those of a prompt whose attention schedule is measured: ``harness.eviction.layer_budgets``);
no kernel is touched. The hook reads ``forward``'s first positional argument as the query: listed,
with ``forward``'s parameters, in ``harness.engine.patches`` ("hooked on an instance"). After the step the copies join each request's window in the worker's
``PolicyState`` (or the measurement's); nothing is captured (and no hook does any work) for a step in which no request
needs it.

Compiled graphs (``torch.compile``, CUDA graphs) do not run Python hooks per step, so capture
needs eager mode; attention variants whose weights are not ``softmax(q.k * scale)`` (logit soft
cap, ALiBi, attention sinks) are refused too: the recomputed attention would not be what the kernel
computed. A sliding-window layer is not: on a hybrid model (Gemma 3) eviction acts on the
full-attention layers only and leaves the sliding-window layers to vLLM
(``harness.engine.layer_groups.policies_by_group``: their groups' policy, ``FullCache``, reads no
queries), so their queries are neither copied nor kept (Gemma 3 270M: a SnapKV window for its 3
global layers, not all 18).
"""
from __future__ import annotations

import time

import torch

from harness.eviction.state import PolicyState


def unsupported_reason(runner, modules) -> str | None:
    """Why this engine cannot give attention-aware policies their window (None: it can). Reads the
    layer's own settings (``attention.py:335-340``: ``num_heads``, ``head_size``,
    ``sliding_window``, ``has_sink``) and its backend's (``impl.logits_soft_cap``,
    ``impl.alibi_slopes``, ``impl.scale``: ``v1/attention/backends/cpu_attn.py:304-322``,
    ``flash_attn.py:1072``)."""
    if not runner.model_config.enforce_eager:
        return ("attention-aware policies read queries from a hook on each attention layer, which compiled "
                "graphs skip: run with enforce_eager (engine.enforce_eager=true, --enforce-eager)")
    for module in modules:
        if module.sliding_window is not None:
            continue  # never evicted, so never scored (above)
        impl = module.impl
        if getattr(impl, "logits_soft_cap", None) or getattr(impl, "alibi_slopes", None) is not None or module.has_sink:
            return (f"attention-aware policies recompute softmax(q.k * scale); layer {module.layer_name} adds a "
                    "logit soft cap, ALiBi or sinks")
    return None


class QueryCapture:
    """Hooks on a runner's attention layers (in KV-cache layer order) and this step's capture plan."""

    def __init__(self, runner, modules: list):
        self.modules = modules
        self.scales = [float(module.impl.scale) for module in modules]
        self.unsupported = unsupported_reason(runner, modules)
        self.rows: torch.Tensor | None = None           # this step's query rows to copy
        self.owners: list[tuple[str, int, int, int]] = []  # (request id, rows, window size, target) in row order
        self.copies: list[torch.Tensor | None] = [None] * len(modules)
        self.seconds = 0.0                               # this step's time copying queries so far
        # the layers whose queries a policy may read: every full-attention one (a sliding-window
        # layer's group never evicts, above)
        self.captured = [module.sliding_window is None for module in modules]
        if self.unsupported is None:
            for index, module in enumerate(modules):
                if self.captured[index]:
                    module.register_forward_pre_hook(self._hook(index))

    def _hook(self, index: int):
        def copy_queries(module, args):
            if self.rows is None:
                return
            started = time.perf_counter()
            query = args[0]
            self.copies[index] = query.reshape(query.shape[0], module.num_heads, module.head_size).index_select(0, self.rows)
            self.seconds += time.perf_counter() - started
        return copy_queries

    def plan(self, wanted: list[tuple[str, int, int, int, int]], device) -> None:
        """``wanted``: (request id, first row, end row, window size, target) of each window to
        capture; ``target`` indexes the state lists ``absorb`` is given (a request may be wanted
        by two: its policy's window and the schedule's measurement)."""
        self.rows, self.owners = None, []
        if not wanted:
            return
        rows = []
        for request_id, start, end, size, target in wanted:
            take = min(size, end - start)
            rows.append(torch.arange(end - take, end))
            self.owners.append((request_id, take, size, target))
        self.rows = torch.cat(rows).to(device)

    def absorb(self, targets: list[list[PolicyState]], group_layers: list[list[int]]) -> float:
        """Hand this step's copies to each request's window, in each KV cache group's state (of the
        owner's target) its own layers (``group_layers``: positions in layer order; one group: every
        layer), a sliding-window group's state none; returns the seconds this step spent capturing
        (the hooks' copies and this)."""
        if self.rows is None:
            return 0.0
        started = time.perf_counter()
        if any(copy is None for copy, captured in zip(self.copies, self.captured) if captured):
            raise RuntimeError("an attention layer ran without capturing the queries planned for it")
        # [layers, rows, heads, dim] per group whose layers are captured
        parts = [torch.stack([self.copies[layer] for layer in layers]) if all(self.captured[layer] for layer in layers)
                 else None for layers in group_layers]
        offset = 0
        for request_id, count, size, target in self.owners:
            for state, part in zip(targets[target], parts):
                if part is not None:
                    state.observe(request_id, part[:, offset : offset + count], size)
            offset += count
        self.rows, self.owners, self.copies = None, [], [None] * len(self.modules)
        seconds, self.seconds = self.seconds + time.perf_counter() - started, 0.0
        return seconds

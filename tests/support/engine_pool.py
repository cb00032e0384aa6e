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

Shared: engines with the engine core in the test's process (``in_process``) and one worker. Tensor
parallel and separate-core engines run in a process of their own, as before (their workers would
wait between batches on shared-memory queues).

    python -m tests.support.engine_pool LOG     (the server: one line per batch on stdin,
                                                {"spec": SPEC.json, "out": OUT.json}; answers
                                                "ok" or "error" on stdout, the batch's result or
                                                traceback in OUT.json)

The server takes batch_run's own engine: ``batch_run.run`` builds ``harness.engine.llm.Engine`` for
its spec, and the server hands back the engine it already holds for the same arguments.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
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


def shareable(spec: dict) -> bool:
    engine = spec.get("engine", {})
    return engine.get("in_process", True) and engine.get("tensor_parallel_size", 1) == 1


def engine_key(spec: dict) -> str:
    return json.dumps({key: spec.get(key) for key in ENGINE_KEYS}, sort_keys=True)


class Server:
    """One engine process (``python -m tests.support.engine_pool``) and its log."""

    def __init__(self, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"engine_server_{time.monotonic_ns()}.log"
        with open(self.log, "w") as log:  # (until the server sends its own output there)
            self.process = subprocess.Popen([sys.executable, "-m", "tests.support.engine_pool", str(self.log)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                            cwd=ROOT)
        self.batches = 0

    def run(self, spec: dict, workdir: Path, timeout_s: float) -> tuple[dict, bool]:
        """The batch's result, and whether the server stays up for another."""
        import tempfile

        with tempfile.TemporaryDirectory(dir=workdir) as scratch:
            spec_file, out_file = Path(scratch) / "spec.json", Path(scratch) / "out.json"
            spec_file.write_text(json.dumps(spec))
            self.process.stdin.write(json.dumps({"spec": str(spec_file), "out": str(out_file)}) + "\n")
            self.process.stdin.flush()
            answer = self._answer(timeout_s)
            self.batches += 1
            if answer in ("ok", "ok retire"):
                return json.loads(out_file.read_text()), answer == "ok"
            why = out_file.read_text() if answer == "error" and out_file.exists() else f"no answer ({answer})"
            self.close()
            raise RuntimeError(f"engine process failed (batch {self.batches} on this engine):\n{why[-4000:]}\n"
                               f"--- its log's end:\n{self.log_tail()}")

    def _answer(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.process.kill()
                self.process.wait()
                return f"timed out after {timeout_s:.0f} s"
            ready, _, _ = select.select([self.process.stdout], [], [], min(left, 5.0))
            if ready:
                line = self.process.stdout.readline()
                return line.strip() if line else f"the process ended (exit {self.process.wait()})"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()  # between batches the server then exits at once
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


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
        if server is None or server.process.poll() is not None:
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


def serve(log: Path) -> int:
    """The server: batches from stdin until it closes, on one engine built by the first."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log, "a", buffering=1) as sink:
        os.dup2(sink.fileno(), 1)  # vLLM's prints and logs go to the log, never into the answers
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
    while line := sys.stdin.readline():
        paths = json.loads(line)
        out = Path(paths["out"])
        started = time.perf_counter()
        try:
            result = batch_run.run(json.loads(Path(paths["spec"]).read_text()))
        except BaseException:
            out.write_text(traceback.format_exc())
            answers.write("error\n")
            break  # the engine's state is unknown: the next batch of this configuration gets a new one
        out.write_text(json.dumps(result))
        print(f"[engine_pool] batch of {len(result['outputs'])} request(s) done in {time.perf_counter() - started:.1f} s",
              flush=True)
        answers.write(("ok" if ready_for_next(held["engine"], held["free"]) else "ok retire") + "\n")
    # Done (stdin closed) or failed. One in-process engine and one worker hold nothing outside this
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


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1])))

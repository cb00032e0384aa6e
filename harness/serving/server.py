"""``vllm serve`` as users type it, with the eviction scheduler and prefix caching on, for the serving
benchmark: started, waited on until healthy, its prefix cache emptied between runs, its Prometheus
gauges sampled beside a run (``GaugeSampler``), stopped cleanly.

No eviction setting is given at start (no ``--additional-config``): every request brings its own
through ``vllm_xargs`` (docs/serving.md), so one server runs every configuration of a sweep. The
server runs with ``VLLM_SERVER_DEV_MODE=1`` for vLLM's ``POST /reset_prefix_cache``
(vllm/entrypoints/launchers/api_server/routers.py:40-43, serve/dev/cache/api_router.py:20-43), which
the eviction scheduler extends to its compressed contexts (harness/engine/scheduler.py,
``reset_prefix_cache``): each run then starts cold, as the first configuration of a sweep does.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = "harness.engine.scheduler.EvictionScheduler"
# the gauges sampled beside a run (vllm/v1/metrics/loggers.py: kv_cache_usage_perc at :620)
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def block_bytes(model_path: str, block_size: int, dtype: str = "float32") -> int:
    """One block of vLLM's KV pool in bytes (``harness.config.models.pool_block_bytes``: one KV cache
    group's layers, K and V): what ``--kv-cache-memory-bytes`` must give per block of the pool asked for."""
    from harness.config.models import pool_block_bytes

    found = pool_block_bytes(model_path, dtype, block_size)
    if found is None:
        raise ValueError(f"{model_path}: no config.json giving the model's layers and heads")
    return found


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each metric's value summed over its label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


class Server:
    """``vllm serve MODEL`` with the eviction scheduler, prefix caching on and a KV pool of
    ``pool_bytes``; its output goes to ``log`` (a pipe nobody reads would fill and stop it)."""

    def __init__(self, model: str, log: Path, *, pool_bytes: int, block_size: int = 32, dtype: str = "float32",
                 max_model_len: int = 8192, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192,
                 extra: tuple[str, ...] = (), port: int | None = None):
        self.model, self.log_path, self.port = model, Path(log), port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--host", "127.0.0.1",
                        "--port", str(self.port), "--dtype", dtype, "--block-size", str(block_size),
                        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                        "--max-num-batched-tokens", str(max_num_batched_tokens), "--enforce-eager",
                        "--enable-prefix-caching", "--scheduler-cls", SCHEDULER,
                        # each response's cached prompt tokens, which a conversation's turns report
                        # (usage.prompt_tokens_details: vllm/entrypoints/openai/completion/serving.py:453-456;
                        # the flag: vllm/entrypoints/launchers/cli_args.py:148)
                        "--enable-prompt-tokens-details",
                        "--kv-cache-memory-bytes", str(pool_bytes), *extra]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 600) -> None:
        env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", VLLM_SERVER_DEV_MODE="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())),
                   # the console script puts no working directory on sys.path: the plugin's scheduler
                   # (--scheduler-cls) is imported from the repository
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if urllib.request.urlopen(f"{self.base_url}/health", timeout=5).status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve did not come up in {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        self.process = None

    def log_tail(self, size: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-size:]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30).read().decode())

    def pool_blocks(self) -> int:
        """The KV pool vLLM made, in blocks (the ``num_gpu_blocks`` label of ``vllm:cache_config_info``),
        its null block included (``harness.serving.summary.usable_blocks``: what requests can hold)."""
        import re

        text = urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30).read().decode()
        found = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M)
        if found is None:
            raise RuntimeError("vllm:cache_config_info gives no num_gpu_blocks")
        return int(found.group(1))

    def eviction_state(self, reset: bool = False) -> dict | None:
        """The eviction scheduler's settings and ledger (``GET /kv_eviction/state``,
        ``harness.engine.frontend.STATE_ROUTE``), its measurements reset first with ``reset``; None
        where the server answers 404 (vLLM's own scheduler)."""
        import urllib.error

        from harness.engine.frontend import STATE_ROUTE

        try:
            answer = urllib.request.urlopen(f"{self.base_url}{STATE_ROUTE}{'?reset=true' if reset else ''}", timeout=60)
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise
        return json.loads(answer.read().decode())

    def reset_prefix_cache(self, timeout: float = 60) -> None:
        """Empty the prefix cache (and the compressed contexts): vLLM refuses while blocks are held
        (``success: false``), so retry until every request has let go of its blocks."""
        deadline = time.time() + timeout
        while True:
            request = urllib.request.Request(f"{self.base_url}/reset_prefix_cache", method="POST", data=b"")
            answer = json.loads(urllib.request.urlopen(request, timeout=30).read().decode() or "{}")
            if answer.get("success"):
                return
            if time.time() > deadline:
                raise RuntimeError(f"the prefix cache could not be reset in {timeout:.0f} s: {answer}")
            time.sleep(0.5)


class GaugeSampler:
    """Samples the server's gauges (``GAUGES``) every ``interval`` seconds in a thread, beside a
    benchmark run: ``samples`` is a list of {"t": seconds since start, gauge: value}."""

    def __init__(self, server: Server, interval: float = 0.5):
        self.server, self.interval = server, interval
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GaugeSampler":
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                values = self.server.metrics()
                self.samples.append({"t": round(time.perf_counter() - self._started, 3),
                                     **{gauge: values.get(gauge) for gauge in GAUGES}})
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # a sample missed while the server is busy: the next one comes
            self._stop.wait(self.interval)


def gauge_summary(samples: list[dict], gauge: str = "vllm:kv_cache_usage_perc") -> dict:
    """Mean and peak of a gauge over a run's samples, and how many there were."""
    values = [s[gauge] for s in samples if s.get(gauge) is not None]
    return {"samples": len(values), "mean": sum(values) / len(values) if values else None,
            "peak": max(values) if values else None}

"""What one eviction costs in extra memory and time, against context length and model shape.

    python experiments/eviction_cost.py                 # before = the evictor at BASELINE, after = this tree
    python experiments/eviction_cost.py --before REV    # compare with another commit's evictor

No engine: synthetic paged caches in the FlashAttention layout, shaped like the models' KV caches
(Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims in bfloat16; SmolLM2-135M: 30 x 3 x 64 in
float32), random K/V, one request's blocks shuffled in the pool. Each measurement runs in a fresh
process with the code of one commit on its path (the old code is extracted with ``git archive``),
so "before" and "after" are the real evictors, measured side by side in one run:

* extra memory: the peak of the process's resident memory during the eviction above what it held
  before (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), with glibc told to mmap
  every allocation above 64 KiB so that temporaries cannot hide in memory freed earlier;
* time: wall time of the eviction (CPU, 2 threads; on a GPU the evictor synchronizes the device).

Decode cases are the steady state: a request at budget + one block, after an earlier eviction
(the first fills the per-request score cache). Writes ``results/eviction_cost/summary.md`` and
``.csv``.

    python experiments/eviction_cost.py --batch         # a full batch: one request at a time vs together

``--batch``: every request of a batch due in the same decode step (equal lengths, as in the
throughput workloads), evicted with this tree's evictor one request at a time (``evict`` per
request, as the worker did before) and all together (``evict_all``: joint reads per layer, in
groups of at most the view's ``joint_read_bytes``), each in a fresh process, interleaved and
repeated; medians and the ratio. Writes ``results/eviction_cost/batch.md`` and ``batch.csv``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "0c18297"  # main before the evictor streamed layers and cached scores
BLOCK = 16  # the paper's GPU block size

SHAPES = {
    "llama-3.1-8b": dict(layers=32, heads=8, dim=128, dtype="bfloat16"),
    "smollm2-135m": dict(layers=30, heads=3, dim=64, dtype="float32"),
}
# (shape, policy, phase, budget, tokens the request holds when it evicts)
CASES = [
    ("llama-3.1-8b", "paged", "decode", 1024, 1024 + BLOCK),
    ("llama-3.1-8b", "paged", "decode", 4096, 4096 + BLOCK),
    ("llama-3.1-8b", "paged", "decode", 8192, 8192 + BLOCK),
    ("llama-3.1-8b", "knorm", "decode", 4096, 4096 + BLOCK),
    ("llama-3.1-8b", "streaming", "decode", 4096, 4096 + BLOCK),
    ("llama-3.1-8b", "paged", "prefill", 1024, 8192),
    ("smollm2-135m", "paged", "decode", 1024, 1024 + BLOCK),
    ("smollm2-135m", "paged", "prefill", 1024, 6144),
]


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure(case: dict) -> dict:
    """One eviction, in this process, with whichever evictor is first on the path."""
    import inspect
    import time

    import torch

    try:
        from harness.eviction import evictor
        from harness.eviction.state import PolicyState
        from harness.engine.backend_views import FlashAttnView
    except ImportError:  # a commit from before the eviction core had a package of its own
        from harness.engine import evictor
        from harness.engine.kv_view import FlashAttnView
        PolicyState = getattr(evictor, "ScoreBook", None)
    from policies import make_policy

    torch.set_num_threads(2)
    shape = SHAPES[case["shape"]]
    dtype = getattr(torch, shape["dtype"])
    blocks = -(-case["tokens"] // BLOCK) + 2
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randn(blocks + 1, shape["heads"], BLOCK, 2 * shape["dim"], generator=generator).to(dtype)
              for _ in range(shape["layers"])]
    view = FlashAttnView(layers)
    block_ids = (torch.randperm(blocks, generator=generator) + 1).tolist()
    policy = make_policy(case["policy"], case["budget"], BLOCK)
    parameters = inspect.signature(evictor.evict).parameters
    state_argument = next((name for name in ("state", "book") if name in parameters), None)  # renamed at 2026-11-24
    cached = state_argument is not None
    kwargs = {state_argument: PolicyState(), "request_id": "r"} if cached else {}
    tokens = case["tokens"]
    if case["phase"] == "decode":  # an earlier eviction first: the steady state
        warm = evictor.evict(policy, view, block_ids, tokens, "decode", **kwargs)
        for position in sorted(warm.dropped_blocks, reverse=True):
            block_ids.append(block_ids.pop(position))  # reused for the next block's tokens
        tokens = tokens - warm.evicted_tokens + BLOCK
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_bytes("VmHWM")
    started = time.perf_counter()
    evictor.evict(policy, view, block_ids, tokens, case["phase"], **kwargs)
    seconds = time.perf_counter() - started
    return {"extra_bytes": max(status_bytes("VmHWM") - before, 0), "seconds": seconds,
            "evictor": inspect.getsourcefile(evictor), "score_cache": cached}


# (shape, view, policy, budget, requests): the throughput "attention" workload's batch on SmolLM2
# (12 requests at budget 512, CPU layout, block 32), and a GPU-sized batch on Llama-3.1-8B's shape.
BATCH_CASES = [
    *[("smollm2-135m", "cpu_attn", policy, 512, 12) for policy in ("paged", "knorm", "learned", "snapkv", "h2o")],
    ("llama-3.1-8b", "flash_attn", "paged", 1024, 16),
    ("llama-3.1-8b", "flash_attn", "knorm", 1024, 16),
]
BATCH_BLOCK = {"cpu_attn": 32, "flash_attn": BLOCK}
QUERY_HEADS = {"smollm2-135m": 9, "llama-3.1-8b": 32}


def measure_batch(case: dict) -> dict:
    """One decode step in which every request of the batch evicts, in this process: after a warm-up
    eviction of every request (the steady state), the batch grows a block and evicts again."""
    import time

    import torch

    from harness.engine.backend_views import CpuAttnView, FlashAttnView
    from harness.eviction.evictor import Due, evict, evict_all
    from harness.eviction.state import PolicyState
    from policies import make_policy

    torch.set_num_threads(2)
    shape, block = SHAPES[case["shape"]], BATCH_BLOCK[case["view"]]
    dtype = getattr(torch, shape["dtype"])
    requests, budget = case["requests"], case["budget"]
    per_request = (budget + 2 * block) // block
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randn(requests * per_request + 1, shape["heads"], block, 2 * shape["dim"], generator=generator).to(dtype)
              for _ in range(shape["layers"])]
    view = (CpuAttnView if case["view"] == "cpu_attn" else FlashAttnView)(layers)
    order = (torch.randperm(requests * per_request, generator=generator) + 1).tolist()
    tables = [order[r * per_request : (r + 1) * per_request] for r in range(requests)]
    policy = make_policy(case["policy"], budget, block)
    state = PolicyState(scales=[shape["dim"] ** -0.5] * shape["layers"])

    def step(tokens: int) -> float:
        if policy.query_window:  # the window's queries, as the capture would have left them
            for r in range(requests):
                state.observe(f"r{r}", torch.randn(shape["layers"], block, QUERY_HEADS[case["shape"]], shape["dim"],
                                                   generator=generator).to(dtype), policy.query_window)
        dues = [Due(f"r{r}", policy, tables[r], tokens, "decode") for r in range(requests)]
        started = time.perf_counter()
        if case["mode"] == "together":
            evictions = evict_all(view, dues, state)
        else:
            evictions = {d.request_id: evict(policy, view, d.block_ids, d.tokens, d.phase, state, d.request_id) for d in dues}
        seconds = time.perf_counter() - started
        for r in range(requests):
            for position in sorted(evictions[f"r{r}"].dropped_blocks, reverse=True):
                tables[r].append(tables[r].pop(position))  # a dropped block is reused for new tokens
        return seconds

    step(budget + block)  # warm-up: fills per-request scores and totals
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmHWM")
    seconds = step(budget + block)
    from harness.eviction.memory import predict
    from harness.config.models import ModelShape

    model = ModelShape(shape["layers"], shape["heads"], QUERY_HEADS[case["shape"]], shape["dim"], dtype.itemsize)
    predicted = predict(policy, model, requests, budget + block, view.joint_read_bytes)
    return {"extra_bytes": max(status_bytes("VmHWM") - before, 0), "seconds": seconds, "predicted_bytes": predicted.total}


def run_batch(case: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, __file__, "--batch-child", json.dumps(case)], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def batch_report(rows: list[dict], repeats: int, revision: str) -> str:
    from statistics import median

    from tabulate import tabulate

    header = ["model shape", "layout", "policy", "budget", "requests", "ms one at a time", "ms together",
              "speed-up", "extra MiB one at a time", "extra MiB together", "predicted MiB"]
    table = []
    for key in dict.fromkeys((r["shape"], r["view"], r["policy"], r["budget"], r["requests"]) for r in rows):
        one = [r for r in rows if (r["shape"], r["view"], r["policy"], r["budget"], r["requests"]) == key and r["mode"] == "one"]
        both = [r for r in rows if (r["shape"], r["view"], r["policy"], r["budget"], r["requests"]) == key and r["mode"] == "together"]
        one_s, both_s = median(r["seconds"] for r in one), median(r["seconds"] for r in both)
        table.append([*key, f"{one_s * 1e3:.0f}", f"{both_s * 1e3:.0f}", f"{one_s / both_s:.2f}x",
                      f"{median(r['extra_bytes'] for r in one) / 2**20:.1f}",
                      f"{median(r['extra_bytes'] for r in both) / 2**20:.1f}",
                      f"{both[0]['predicted_bytes'] / 2**20:.1f}"])
    return (f"# A full batch's decode evictions: one request at a time vs together (evictor at {revision})\n\n"
            f"Command: `python experiments/eviction_cost.py --batch` (CPU, 2 threads; synthetic caches; every "
            f"request of the batch due in one step, in the steady state; medians of {repeats} interleaved "
            "repeats, each in a fresh process; extra MiB: the peak resident memory above the start of the step, "
            "which takes the step's new query windows and the evictions' scratch; predicted MiB: "
            "`harness.eviction.memory.predict` for the batch, its policy state and one step's scratch).\n\n"
            + tabulate(table, headers=header, tablefmt="github") + "\n")


def run_case(case: dict, tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], capture_output=True,
                          text=True, env=env, cwd=tree)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["evictor"].startswith(str(tree)):
        raise RuntimeError(f"measured {result['evictor']}, not the evictor under {tree}")
    return result


def extract(revision: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", revision, "harness", "policies"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def memory_ratio(before: int, after: int) -> str:
    """before / after; under 1 MiB after, the ratio against 1 MiB, as a lower bound."""
    if after < 2**20:
        return f">= {before / 2**20:.0f}x"
    return f"{before / after:.1f}x"


def report(rows: list[dict], before: str, after: str) -> str:
    from tabulate import tabulate

    header = ["model shape", "policy", "phase", "budget", "tokens held", "extra MiB before", "extra MiB after",
              "memory ratio", "ms before", "ms after", "speed-up"]
    table = [[r["shape"], r["policy"], r["phase"], r["budget"], r["tokens"],
              f"{r['before_bytes'] / 2**20:.1f}", f"{r['after_bytes'] / 2**20:.1f}",
              memory_ratio(r["before_bytes"], r["after_bytes"]),
              f"{r['before_s'] * 1e3:.1f}", f"{r['after_s'] * 1e3:.1f}", f"{r['before_s'] / r['after_s']:.1f}x"]
             for r in rows]
    return (f"# One eviction's extra memory and time (before = {before}, after = {after})\n\n"
            f"Command: `python experiments/eviction_cost.py --before {before}` (CPU, 2 threads; synthetic "
            f"FlashAttention-layout caches, block {BLOCK}).\n\n" + tabulate(table, headers=header, tablefmt="github") + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BASELINE, help="git revision of the evictor to compare with")
    parser.add_argument("--out", default=str(ROOT / "results" / "eviction_cost"))
    parser.add_argument("--batch", action="store_true", help="a full batch: one request at a time vs together")
    parser.add_argument("--repeats", type=int, default=3, help="--batch: interleaved repeats per case")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--batch-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    if args.batch_child:
        print(json.dumps(measure_batch(json.loads(args.batch_child))))
        return 0
    after = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "harness", "policies"], cwd=ROOT, capture_output=True, text=True).stdout
    after += "+dirty" if dirty.strip() else ""
    if args.batch:
        return main_batch(args, after)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        old_tree = extract(args.before, Path(scratch))
        for shape, policy, phase, budget, tokens in CASES:
            case = dict(shape=shape, policy=policy, phase=phase, budget=budget, tokens=tokens)
            old, new = run_case(case, old_tree), run_case(case, ROOT)
            rows.append(dict(case, before_bytes=old["extra_bytes"], after_bytes=new["extra_bytes"],
                             before_s=old["seconds"], after_s=new["seconds"]))
            last = report(rows[-1:], args.before, after).splitlines()[-1]
            print(last, flush=True)
    return write_results(Path(args.out), "summary", report(rows, args.before, after), rows)


def write_results(out: Path, name: str, text: str, rows: list[dict]) -> int:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    pd.DataFrame(rows).to_csv(out / f"{name}.csv", index=False)
    print("\n" + text)
    return 0


def main_batch(args, revision: str) -> int:
    rows = []
    for repeat in range(args.repeats):
        for shape, view, policy, budget, requests in BATCH_CASES:
            for mode in ("one", "together") if repeat % 2 == 0 else ("together", "one"):
                case = dict(shape=shape, view=view, policy=policy, budget=budget, requests=requests, mode=mode)
                rows.append(dict(case, repeat=repeat, **run_batch(case)))
                print(f"[batch] repeat {repeat + 1}/{args.repeats} {shape} {policy} {mode}: "
                      f"{rows[-1]['seconds'] * 1e3:.0f} ms", flush=True)
    return write_results(Path(args.out), "batch", batch_report(rows, args.repeats, revision), rows)


if __name__ == "__main__":
    sys.exit(main())

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
(the first fills the per-request score cache). Writes ``results/eviction_cost/summary.md``,
``.csv`` and ``summary_run.json`` (the command, the two revisions and the run's provenance: git
commit, code version). One timing per case and evictor, so no test and no verdict: the summary's
first line says so (``NO_VERDICT_ONE``).

    python experiments/eviction_cost.py --batch         # a full batch: one request at a time vs together

``--batch``: every request of a batch due in the same decode step (equal lengths, as in the
throughput workloads), evicted with this tree's evictor one request at a time (``evict`` per
request, as the worker did before) and all together (``evict_all``: joint reads per layer, in
groups of at most the view's ``joint_read_bytes``), each in a fresh process, interleaved and
repeated; medians and the ratio. Writes ``results/eviction_cost/batch.md``, ``batch.csv`` and
``batch_run.json``. No test runs on so few repeats (the first line says what one could reach).

    python experiments/eviction_cost.py --summary-only [--out DIR]   # the summaries again from the CSVs

``--summary-only`` measures nothing: it rewrites ``summary.md`` and ``batch.md`` from the committed
``summary.csv`` and ``batch.csv`` (of ``--data``), naming the commit that measured them (from the
run's JSON, or where the run predates it, the revisions its committed summary's title recorded and
the commit that committed the CSV) and the code version that rendered them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
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


# The summaries' first lines (issue 65, item 2: each summary states what its design can decide).
NO_VERDICT_ONE = ("**No verdict: one measurement per row, no interval.** Each row times one eviction once with "
                  "each evictor (one fresh process each, no repeats), so no test is run: no p-value, no smallest "
                  "attainable p, no family, and no word of `harness.analysis.verdicts`. A memory ratio or speed-up is "
                  "one reading, not an estimate with an error; one near 1.0x says nothing about which is faster.")


def harness_path() -> None:
    """Put this tree's harness on the path, in the parent process only: a child measuring another
    commit's evictor must import that commit's harness (``run_case`` checks it did)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def no_verdict_repeats(repeats: int, rows: int) -> str:
    """The batch summary's first line: medians of ``repeats`` interleaved repeats, no test, and
    what a paired sign-flip test over the repeats could reach (``harness.analysis.stats``)."""
    harness_path()
    from harness.analysis.stats import can_decide, smallest_p

    could = (f"a paired sign-flip test over {repeats} repeats could reach p = {smallest_p(repeats):.3g} at the least, "
             + ("so with Holm over the table's rows it could decide, but none is run."
                if can_decide([repeats] * rows) else
                f"which with Holm over the table's {rows} rows cannot decide anything, so none is run."))
    return (f"**No verdict: medians of {repeats} interleaved repeats per row, no interval.** No test and no word of "
            f"`harness.analysis.verdicts`: {could} A speed-up near 1.00x says nothing about which is faster.")


def rendered_by() -> str:
    harness_path()  # (imported late: a child measuring the old evictor imports the old commit's code)
    from harness.records.provenance import loaded_text

    return loaded_text()


def measured_origin(data: Path, name: str, title: re.Pattern) -> tuple[dict, str]:
    """The measuring run's record (``<name>_run.json``) and a sentence naming the commit that
    measured ``<name>.csv`` and the code that renders its summary. A run from before the record
    kept only its title's revisions: read from the summary committed with the CSV (``title``'s
    groups), beside the commit that committed the CSV."""
    harness_path()  # (imported late, as in rendered_by)
    from harness.records.provenance import last_commit_of, measured_and_rendered

    record = data / f"{name}_run.json"
    if record.exists():
        run = json.loads(record.read_text())
        prov = run.get("provenance") or {}
        return run, measured_and_rendered(prov)
    try:
        relative = (data / f"{name}.csv").resolve().relative_to(ROOT)
        commit = last_commit_of(relative, ROOT) or ""
        printed = subprocess.run(["git", "show", f"{commit}:{relative.with_suffix('.md')}"], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout
    except (OSError, ValueError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"{data / name}.csv: no {record.name} and no committed {name}.md to read its revisions "
                         f"from ({error})")
    found = title.search(printed.splitlines()[0] if printed else "")
    if not commit or not found:
        raise SystemExit(f"{data / name}.csv: no {record.name}, and the committed {name}.md's title names no revisions")
    run = found.groupdict()
    return run, (f"Measured at commit {run['after']} (as its title recorded; code version not recorded then); "
                 f"data committed at commit {commit}; summary rendered at {rendered_by()} by "
                 "`python experiments/eviction_cost.py --summary-only`.")


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


def batch_report(rows: list[dict], repeats: int, revision: str, origin: str) -> str:
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
            + no_verdict_repeats(repeats, len(table)) + "\n\n"
            f"Command: `python experiments/eviction_cost.py --batch` (CPU, 2 threads; synthetic caches; every "
            f"request of the batch due in one step, in the steady state; medians of {repeats} interleaved "
            "repeats, each in a fresh process; extra MiB: the peak resident memory above the start of the step, "
            "which takes the step's new query windows and the evictions' scratch; predicted MiB: "
            "`harness.eviction.memory.predict` for the batch, its policy state and one step's scratch). "
            + origin + "\n\n" + tabulate(table, headers=header, tablefmt="github") + "\n")


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


def report(rows: list[dict], before: str, after: str, origin: str = "") -> str:
    from tabulate import tabulate

    header = ["model shape", "policy", "phase", "budget", "tokens held", "extra MiB before", "extra MiB after",
              "memory ratio", "ms before", "ms after", "speed-up"]
    table = [[r["shape"], r["policy"], r["phase"], r["budget"], r["tokens"],
              f"{r['before_bytes'] / 2**20:.1f}", f"{r['after_bytes'] / 2**20:.1f}",
              memory_ratio(r["before_bytes"], r["after_bytes"]),
              f"{r['before_s'] * 1e3:.1f}", f"{r['after_s'] * 1e3:.1f}", f"{r['before_s'] / r['after_s']:.1f}x"]
             for r in rows]
    return (f"# One eviction's extra memory and time (before = {before}, after = {after})\n\n{NO_VERDICT_ONE}\n\n"
            f"Command: `python experiments/eviction_cost.py --before {before}` (CPU, 2 threads; synthetic "
            f"FlashAttention-layout caches, block {BLOCK}). {origin}".rstrip() + "\n\n"
            + tabulate(table, headers=header, tablefmt="github") + "\n")


SUMMARY_TITLE = re.compile(r"\(before = (?P<before>\S+), after = (?P<after>\S+)\)")
BATCH_TITLE = re.compile(r"\(evictor at (?P<after>\S+)\)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BASELINE, help="git revision of the evictor to compare with")
    parser.add_argument("--out", default=str(ROOT / "results" / "eviction_cost"))
    parser.add_argument("--batch", action="store_true", help="a full batch: one request at a time vs together")
    parser.add_argument("--repeats", type=int, default=3, help="--batch: interleaved repeats per case")
    parser.add_argument("--summary-only", action="store_true",
                        help="measure nothing: rewrite summary.md and batch.md from --data's CSVs into --out")
    parser.add_argument("--data", default=str(ROOT / "results" / "eviction_cost"),
                        help="--summary-only: the folder whose summary.csv and batch.csv (and run JSONs) it reads")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--batch-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    if args.batch_child:
        print(json.dumps(measure_batch(json.loads(args.batch_child))))
        return 0
    if args.summary_only:
        return summary_only(Path(args.data), Path(args.out))
    harness_path()
    from harness.records.provenance import LOADED, provenance

    commit = LOADED["git_commit"] or "unknown"
    after = commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")
    origin = f"Measured and rendered at commit {LOADED['git_commit']} (code version {LOADED['code_version']})."
    if args.batch:
        return main_batch(args, after, origin, provenance())
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
    record = {"command": f"python experiments/eviction_cost.py --before {args.before}", "before": args.before,
              "after": after, "provenance": provenance()}
    return write_results(Path(args.out), "summary", report(rows, args.before, after, origin), rows, record)


def summary_only(data: Path, out: Path) -> int:
    """``summary.md`` and ``batch.md`` again from ``data``'s CSVs (whichever are there), into ``out``."""
    import pandas as pd

    written = 0
    out.mkdir(parents=True, exist_ok=True)
    if (data / "summary.csv").exists():
        run, origin = measured_origin(data, "summary", SUMMARY_TITLE)
        rows = pd.read_csv(data / "summary.csv").to_dict("records")
        text = report(rows, run["before"], run["after"], origin)
        (out / "summary.md").write_text(text)
        print(text)
        written += 1
    if (data / "batch.csv").exists():
        run, origin = measured_origin(data, "batch", BATCH_TITLE)
        rows = pd.read_csv(data / "batch.csv").to_dict("records")
        repeats = len({r["repeat"] for r in rows})
        text = batch_report(rows, repeats, run["after"], origin)
        (out / "batch.md").write_text(text)
        print(text)
        written += 1
    if not written:
        raise SystemExit(f"{data}: neither summary.csv nor batch.csv")
    return 0


def write_results(out: Path, name: str, text: str, rows: list[dict], record: dict) -> int:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    pd.DataFrame(rows).to_csv(out / f"{name}.csv", index=False)
    # The run's own record, so that a later --summary-only names the commit and code version that measured it.
    (out / f"{name}_run.json").write_text(json.dumps(record, indent=2) + "\n")
    print("\n" + text)
    return 0


def main_batch(args, revision: str, origin: str, prov: dict) -> int:
    rows = []
    for repeat in range(args.repeats):
        for shape, view, policy, budget, requests in BATCH_CASES:
            for mode in ("one", "together") if repeat % 2 == 0 else ("together", "one"):
                case = dict(shape=shape, view=view, policy=policy, budget=budget, requests=requests, mode=mode)
                rows.append(dict(case, repeat=repeat, **run_batch(case)))
                print(f"[batch] repeat {repeat + 1}/{args.repeats} {shape} {policy} {mode}: "
                      f"{rows[-1]['seconds'] * 1e3:.0f} ms", flush=True)
    record = {"command": "python experiments/eviction_cost.py --batch" + (
        f" --repeats {args.repeats}" if args.repeats != 3 else ""), "after": revision, "repeats": args.repeats,
        "provenance": prov}
    return write_results(Path(args.out), "batch", batch_report(rows, args.repeats, revision, origin), rows, record)


if __name__ == "__main__":
    sys.exit(main())

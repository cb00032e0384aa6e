"""The serving sweep end to end (``experiments/serving.py`` parses its options into ``Options``):
the workload built, one ``vllm serve`` started, the rates set (given, or fractions of full cache's
measured capacity), every run of the sweep, and what it writes under ``out``:

* ``runs/<trial>-<rate>-<configuration>.json``: each run as ``vllm bench serve --save-result
  --save-detailed`` saves it (``generated_texts`` included), ``.gauges.json`` beside it, and
  ``.ledger.json``: the eviction scheduler's state over the run (``GET /kv_eviction/state``);
* ``runs.csv`` (one row per run), ``requests.jsonl`` (one row per served request, scored),
  ``summary.csv`` and ``accuracy.csv`` (``harness.serving.summary``), ``summary.md``, ``pareto.png``,
  ``settings.json`` and ``vllm.log``."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.serving.bench import CAPACITY_FRACTIONS, DEFAULT_GOODPUT

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Options:
    workload: str
    configurations: list[str]
    out: Path
    command: str
    model: str = "smollm2-135m"              # a conf/model name
    ratio: float = 0.5
    rates: list[float] | None = None           # None: fractions of full cache's capacity
    fractions: tuple[float, ...] = CAPACITY_FRACTIONS
    trials: int = 3
    goodput: str = DEFAULT_GOODPUT
    pool_blocks: int | None = None            # None: kv_cache_gib, or half of what full cache needs at once
    kv_cache_gib: float | None = None
    seed: int = 0
    workload_options: dict = field(default_factory=dict)


def check(options: Options) -> None:
    """One line for a bad setting, before any model or server loads."""
    from harness.serving.bench import parse_goodput
    from harness.serving.workloads import WORKLOADS, check_configurations

    if options.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {options.workload!r}; the workloads are: {', '.join(WORKLOADS)}")
    check_configurations(options.configurations)
    if not 0 < options.ratio < 1:
        raise ValueError(f"--ratio {options.ratio}: must be in (0, 1)")
    if options.trials < 1 or options.trials == 2:
        raise ValueError("--trials must be 1 or at least 3 (an interval over two trials says nothing)")
    if options.rates is not None and (not options.rates or any(not r > 0 for r in options.rates)):
        raise ValueError("--rates must be positive request rates (req/s)")
    if any(not f > 0 for f in options.fractions):
        raise ValueError("--fractions must be positive")
    if options.pool_blocks is not None and options.pool_blocks < 1:
        raise ValueError("--pool-blocks must be positive")
    if options.pool_blocks is not None and options.kv_cache_gib is not None:
        raise ValueError("--pool-blocks and --kv-cache-gib both size the pool: give one")
    if options.kv_cache_gib is not None and not options.kv_cache_gib > 0:
        raise ValueError("--kv-cache-gib must be positive")
    if not (ROOT / "conf" / "model" / f"{options.model}.yaml").exists():
        raise ValueError(f"--model {options.model}: no conf/model/{options.model}.yaml")
    parse_goodput(options.goodput)


def model_settings(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))


def model_workload(name: str, model: dict, tokenizer, options: dict):
    """The workload ``name`` built with ``options`` (``harness.serving.workloads.build``), its prompts
    cut at the model's ``max_prompt_tokens`` unless the options say otherwise (the synthetic has none)."""
    from harness.serving.workloads import build

    if name != "prefix_repetition":
        options = {"max_prompt_tokens": model["max_prompt_tokens"], **options}
    return build(name, tokenizer, **options)


def prepare(options: Options) -> tuple:
    """The checks, then the model's settings, path and tokenizer and the workload built: everything
    before a server starts (a ValueError here is a bad setting, in one line)."""
    from transformers import AutoTokenizer

    from harness.config.models import resolve_model_path
    from harness.serving.workloads import check_configurations

    check(options)
    model = model_settings(options.model)
    path = resolve_model_path(model["path"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    workload = model_workload(options.workload, model, tokenizer, {"seed": options.seed, **options.workload_options})
    check_configurations(options.configurations, workload)
    return model, path, tokenizer, workload


def run(options: Options, server=None, prepared: tuple | None = None) -> str:
    """The sweep on a server of its own (or on ``server``, already serving the model: a test's);
    returns ``summary.md``'s text. ``prepared``: what ``prepare`` gave (else it runs here)."""
    from harness.config import engine_defaults
    from harness.serving.workloads import blocks_at_once

    model, path, tokenizer, workload = prepared or prepare(options)
    block = engine_defaults("cpu")["block_size"]
    pool_blocks = options.pool_blocks
    if pool_blocks is None and options.kv_cache_gib is None:
        # The default: a pool where full cache queues, half of what it needs to run every request at once.
        pool_blocks = blocks_at_once(workload, block) // 2
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    with serving(server, model, path, workload, block, pool_blocks, options.kv_cache_gib, out / "vllm.log") as server:
        return measure(options, server, model, path, tokenizer, workload, block)


def serving(server, model: dict, path: str, workload, block: int, pool_blocks: int | None,
            kv_cache_gib: float | None, log: Path):
    """``server`` as it is (a test's), or a ``vllm serve`` of the model with a pool of ``pool_blocks``
    (or ``kv_cache_gib``), long enough for the workload's longest request."""
    from contextlib import nullcontext

    from harness.serving.server import Server, block_bytes

    if server is not None:
        return nullcontext(server)
    # vLLM refuses a pool that cannot hold one request of max_model_len (vllm/v1/core/kv_cache_utils.py:1104,
    # check_enough_kv_cache_memory): serve the workload's longest request, not the model's longest.
    longest = -(-max(item.prompt_bound + item.max_tokens for item in workload.items) // block) * block
    if pool_blocks is not None and pool_blocks * block < longest:
        raise ValueError(f"--pool-blocks {pool_blocks}: the workload's longest request needs {longest // block} blocks")
    # vLLM keeps one null block out of the pool: one more than the blocks asked for
    pool_bytes = ((pool_blocks + 1) * block_bytes(path, block, model.get("dtype", "float32")) if pool_blocks
                  else int(kv_cache_gib * 2**30))
    return Server(path, log, pool_bytes=pool_bytes, block_size=block, dtype=model.get("dtype", "float32"),
                  max_model_len=min(model["max_model_len"], longest))


def measure(options: Options, server, model: dict, path: str, tokenizer, workload, block: int) -> str:
    """Every run of the sweep on ``server``, then the files; returns ``summary.md``'s text."""
    from harness.serving.bench import Bench, arrival_throughput, parse_goodput, rates_from_capacity, served_alone, sweep

    out = Path(options.out)
    pool = server.pool_blocks()
    bench = Bench(server, path, tokenizer, workload, options.ratio, parse_goodput(options.goodput))
    capacity = None
    rates = options.rates
    if rates is None:
        rates = rates_from_capacity(bench, options.fractions, out, options.seed)
        capacity = arrival_throughput(json.loads((out / "runs" / "capacity.json").read_text()))
    rows, requests = sweep(bench, options.configurations, rates, options.trials, out, options.seed)
    alone = served_alone(bench, options.configurations, requests, out)
    from harness.records.provenance import provenance

    settings = {**asdict(options), "out": str(out), "provenance": provenance(), "model": model["name"],
                "model_path": path, "pool_blocks": pool, "block_size": block, "rates": rates, "capacity": capacity,
                "ignore_eos": workload.ignore_eos, "goodput": parse_goodput(options.goodput),
                "description": workload.description, "workload_options": workload.options,
                "contexts": len({item.context for item in workload.items}) if workload.scored else None,
                **({"turns": workload.turns} if workload.turns > 1 else {})}
    (out / "settings.json").write_text(json.dumps(settings, indent=1, default=str) + "\n")
    return write_summaries(out, settings, rows, requests, alone, workload)


def write_summaries(out: Path, settings: dict, rows: list[dict], requests: list[dict], alone: list[dict],
                    workload) -> str:
    """``runs.csv``, ``requests.jsonl``, ``summary.csv``, ``accuracy.csv``, ``summary.md`` and
    ``pareto.png`` from the runs' rows; returns ``summary.md``'s text."""
    import pandas as pd

    from harness.serving import summary
    from harness.serving.workloads import blocks_at_once

    # what full cache needs beside the pool (whether it queues), from the workload, so a sweep saved
    # before this was said gets it too
    settings = {**settings, "full_cache_blocks": blocks_at_once(workload, settings["block_size"])}

    table, accuracy = summary.rate_table(rows), summary.accuracy_table(requests)
    pd.DataFrame(rows).to_csv(out / "runs.csv", index=False)
    pd.DataFrame(table).to_csv(out / "summary.csv", index=False)
    if accuracy:
        pd.DataFrame(accuracy).to_csv(out / "accuracy.csv", index=False)
    with open(out / "requests.jsonl", "w") as handle:
        for row in requests:
            handle.write(json.dumps(row) + "\n")
    from harness.serving.workloads import rate_unit

    text = summary.markdown(table, accuracy, settings, alone, summary.time_split(rows), rows)
    (out / "summary.md").write_text(text)
    summary.plot(table, out / "pareto.png", settings["workload"], rate_unit(settings.get("turns", 1)))
    return text


def summarize(out: Path) -> str:
    """The summaries again from a sweep's saved runs (``runs/*.json`` as vLLM's benchmark saved them,
    their gauges and ledgers, ``alone.json``, ``settings.json``), with no server: the workload rebuilt from the
    settings to score each request's saved text. Returns ``summary.md``'s text."""
    from transformers import AutoTokenizer

    from harness.engine.bench_client import NOT_SENT
    from harness.serving.bench import plan, run_name, run_row, sent_items
    out = Path(out)
    if not (out / "settings.json").is_file():
        raise ValueError(f"{out}: no settings.json (not a serving sweep's folder)")
    from harness.config.models import resolve_model_path

    settings = json.loads((out / "settings.json").read_text())
    model = model_settings(settings["model"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model["path"]))
    workload = model_workload(settings["workload"], model, tokenizer,
                              {"seed": settings["seed"], **settings["workload_options"]})
    rows, requests = [], []
    for entry in plan(settings["configurations"], settings["rates"], settings["trials"]):
        name = out / "runs" / run_name(entry["trial"], entry["rate"], entry["configuration"])
        saved = json.loads(Path(f"{name}.json").read_text())
        items = sent_items(workload, tokenizer, saved)
        sent = [(length, len(item.prompt)) for length, item, error in zip(saved["input_lens"], items, saved["errors"])
                if not (error or "").startswith(NOT_SENT)]  # a failed conversation's unsent turns
        if any(length != prompt for length, prompt in sent) or len(saved["input_lens"]) != len(items):
            raise ValueError(f"{name}.json: its prompts are not the workload rebuilt from settings.json")
        # a sweep saved before the ledger was read (no .ledger.json) keeps its summaries as they were
        ledger = Path(f"{name}.ledger.json")
        state = json.loads(ledger.read_text()) if ledger.is_file() else None
        row, scored = run_row(entry, saved, json.loads(Path(f"{name}.gauges.json").read_text()), items, state)
        rows.append(row)
        requests += scored
    alone = json.loads((out / "alone.json").read_text()) if (out / "alone.json").is_file() else []
    return write_summaries(out, settings, rows, requests, alone, workload)


VERIFIED = "verified.json"  # in a sweep's folder: its last verification
RECOMPUTED = ("summary.md", "summary.csv", "accuracy.csv", "runs.csv", "requests.jsonl")


def against_committed_alone(under_load: list[dict], committed: Path, replay: Path) -> list[dict]:
    """Each replayed request's text (``served_alone``'s entries, in its order per configuration)
    against the committed sweep's text for the same request sent alone, where the sweep saved its
    alone runs; the entry against the text under load where it saved none. ``against`` says which."""
    from harness.serving.bench import alone_run_name, parted_at

    def texts(folder: Path, configuration: str) -> list[str] | None:
        path = folder / "runs" / f"{alone_run_name(configuration)}.json"
        return json.loads(path.read_text())["generated_texts"] if path.is_file() else None

    checked, position = [], {}
    for entry in under_load:
        configuration = entry["configuration"]
        index = position[configuration] = position.get(configuration, -1) + 1
        then = texts(committed, configuration)
        if then is None:
            checked.append({**entry, "against": "under load"})
            continue
        parted = parted_at(texts(replay, configuration)[index], then[index])
        checked.append({**entry, "equal": parted is None, "parted_at_char": parted, "against": "alone"})
    return checked


def verify(out: Path, server=None) -> dict:
    """Does a committed sweep still stand at this code? Two checks, no timing compared:

    * its figures recompute: the summaries rebuilt from the saved runs in a scratch copy
      (``summarize``), each file of ``RECOMPUTED`` there equal, byte for byte, to the committed one;
    * its requests replay: the first ``ALONE`` requests per configuration sent again one at a time
      to a fresh ``vllm serve`` at this code (or ``server``), their texts against the texts the sweep
      got for the same requests sent alone (its ``runs/alone-*.json``): like against like, so that
      a request the sweep itself found to part under load (its ``alone.json``; batch composition
      moves a near tie) does not read as moved code. A sweep that saved no alone run is compared
      with its texts under load (trial 1 at the highest rate, as ``bench.served_alone`` does).

    Writes ``verified.json`` in ``out`` (verdict ``verified`` or ``moved``, what moved, the code it
    ran at and the code the sweep ran at) and returns it."""
    import shutil
    import tempfile
    import time

    from transformers import AutoTokenizer

    from harness.config.models import resolve_model_path
    from harness.records.provenance import code_version, git_commit
    from harness.serving.bench import Bench, served_alone
    from harness.serving.summary import usable_blocks

    out = Path(out).resolve()
    if not (out / "settings.json").is_file():
        raise ValueError(f"{out}: no settings.json (not a serving sweep's folder)")
    settings = json.loads((out / "settings.json").read_text())
    committed = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    moved = []
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "sweep"
        shutil.copytree(out, copy, ignore=shutil.ignore_patterns(VERIFIED))
        summarize(copy)
        moved += [f"{name}: rebuilt from the saved runs, it differs from the committed file" for name in RECOMPUTED
                  if (out / name).is_file() and (copy / name).read_bytes() != (out / name).read_bytes()]
        model = model_settings(settings["model"])
        path = resolve_model_path(model["path"])
        tokenizer = AutoTokenizer.from_pretrained(path)
        workload = model_workload(settings["workload"], model, tokenizer,
                                  {"seed": settings["seed"], **settings["workload_options"]})
        replay = Path(scratch) / "replay"
        replay.mkdir()
        with serving(server, model, path, workload, settings["block_size"], usable_blocks(settings), None,
                     replay / "vllm.log") as running:
            bench = Bench(running, path, tokenizer, workload, settings["ratio"], settings["goodput"])
            under_load = served_alone(bench, settings["configurations"], committed, replay)
        replayed = against_committed_alone(under_load, out, replay)
    moved += [f"{entry['configuration']} {entry['context']} question {entry['question']}: the text parts from the "
              f"committed one ({entry['against']}) at character {entry['parted_at_char']}"
              for entry in replayed if not entry["equal"]]
    record = {"study": f"serving/{out.name}", "verdict": "moved" if moved else "verified",
              "code_version": code_version(ROOT), "git_commit": git_commit(ROOT),
              "ran_at": (settings.get("provenance") or {}).get("code_version"), "moved": moved,
              "recomputed": [name for name in RECOMPUTED if (out / name).is_file()], "replayed": replayed,
              "under_load": under_load,
              "compared": "the summaries rebuilt from the saved runs (byte for byte); the first requests per "
                          "configuration sent again alone at this code, their texts against the committed texts "
                          "of the same requests sent alone (runs/alone-*.json; against those served under load "
                          "where the sweep saved none, 'against' says which); timings are not compared",
              "command": f"python experiments/serving.py --verify --out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}",
              "date": time.strftime("%Y-%m-%d")}
    (out / VERIFIED).write_text(json.dumps(record, indent=1) + "\n")
    return record

"""The one engine lifecycle: cells that share model, data and engine settings run on one engine.

A single cell (``run_cell``, what ``python run.py ...`` runs) is a group of one; a sweep
(``run_grouped``, what ``run.py -m`` runs through the shared-prefill launcher) is its groups one
after the other. For every group: its cells' prompts (``harness.run.cell.prepare_cell``), one
engine, one generation (``harness.engine.shared_prefill.generate_shared``: each cell's request for a
prompt carries the cell's own eviction settings; with several cells each prompt is prefilled once
through vLLM's prefix cache), the teacher-forced likelihood passes, then every cell's record
(scores, fidelity to the full-cache cell beside it, the check that eviction ran) and only then the
run directories, each published atomically. Complete cells are skipped, so a killed sweep resumes
where it stopped. Timings of cells that shared an engine are labelled as shared (``perf.json``
``isolated: false``).
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from harness.config import RunSettings
from harness.config.models import resolve_model_path
from harness.eviction.counters import EvictionCounters
from harness.analysis.studies import refuse_uncommitted
from harness.records.console import engine_output_to, tail
from harness.records.provenance import LOADED
from harness.records.results import RunWriter
from harness.run.cell import CellRecord, CellWork, prepare_cell, publish, record_cell
from harness.run.likelihood import cells_likelihood

ENGINE_LOG = "vllm.log"  # everything vLLM printed while a group ran, kept in its first cell's run directory
SHARED_KEYS = ("model", "data", "engine", "block_size", "seed", "output_dir", "likelihood")


def run_cell(run: RunSettings) -> tuple[str, Path]:
    """One cell, as a group of one; returns ("skipped" | "done", its run directory)."""
    return run_group([run], run.label).get(str(run.run_dir), "skipped"), run.run_dir


def group_key(run: RunSettings) -> str:
    """Cells with the same key can share one engine: they differ only in policy and budget."""
    return json.dumps({key: run.resolved.get(key) for key in SHARED_KEYS}, sort_keys=True, default=str)


def groups_of(runs: list[RunSettings]) -> list[tuple[list[int], list[int]]]:
    """The sweep's groups, in order of first appearance: each group's cells (indices into ``runs``)
    and the distinct run directories among them (full cache appears once per budget in a sweep,
    one run directory), as the index of the first cell naming each."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index, run in enumerate(runs):
        groups[group_key(run)].append(index)
    result = []
    for members in groups.values():
        distinct: dict[str, int] = {}
        for index in members:
            distinct.setdefault(str(runs[index].run_dir), index)
        result.append((members, list(distinct.values())))
    return result


def run_grouped(runs: list[RunSettings]) -> list[str]:
    """Run every cell, one engine per group; returns "done" or "skipped" per cell, in order."""
    groups = groups_of(runs)
    outcome = ["skipped"] * len(runs)
    started = time.perf_counter()
    for number, (members, distinct) in enumerate(groups, 1):
        done = run_group([runs[i] for i in distinct], f"group {number}/{len(groups)}")
        for index in members:
            outcome[index] = done.get(str(runs[index].run_dir), "skipped")
        print(f"[sweep] group {number}/{len(groups)} finished | elapsed {time.perf_counter() - started:.0f}s",
              flush=True)
    return outcome


def run_group(runs: list[RunSettings], name: str) -> dict[str, str]:
    """One engine for cells differing only in policy and budget; returns run dir -> outcome."""
    from transformers import AutoTokenizer

    for run in runs:  # a committed study's cells only from committed code, refused before anything loads
        refuse_uncommitted(run.output_dir, LOADED["code_version"])

    model_path = resolve_model_path(runs[0].model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    works = [work for work in (prepare_cell(run, tokenizer) for run in runs) if work is not None]
    if not works:
        return {}
    check_same_prompts(works)
    writers = [RunWriter(work.target) for work in works]
    log = writers[0].partial / ENGINE_LOG
    try:
        records = generate_and_record(works, model_path, name, log)
        for slot, (record, writer) in enumerate(zip(records, writers)):
            if slot:  # the engine log went into the first cell's directory
                writer.write_text(ENGINE_LOG, f"shared engine: see {works[0].target / ENGINE_LOG}\n")
            publish(record, writer)
    except BaseException:
        keep_engine_log(log, works[0].target)
        for writer in writers:
            writer.abandon()
        raise
    return {str(work.target): "done" for work in works}


def generate_and_record(works: list[CellWork], model_path: str, name: str, log: Path) -> list[CellRecord]:
    """Every cell's generations on one engine, recorded (scored, compared, checked) before any is
    published. One cell gets the engine to itself: its eviction settings are the engine's own
    (checked when it starts), no prefix cache (unless it asks to share compressed contexts), its
    timings isolated."""
    from harness.engine.llm import Engine
    from harness.engine.shared_prefill import CellRequest, generate_shared

    run, alone = works[0].run, len(works) == 1
    prompts = works[0].token_ids
    cells = [[CellRequest(work.eviction_for(i), work.max_new_tokens[i], work.stops[i]) for work in works]
             for i in range(len(prompts))]
    print(f"[engine] starting vLLM for {name}: {len(works)} cell(s) ({', '.join(w.run.label for w in works)}) x "
          f"{len(prompts)} prompts{'' if alone else ', each prompt prefilled once'} "
          f"(its log: {works[0].target / ENGINE_LOG})", flush=True)
    with engine_output_to(log) as terminal:
        # (one cell asking for shared compressed contexts or chained turns gets the prefix cache they go through)
        engine = Engine(model_path, run.model, run.engine, run.block_size, seed=run.seed,
                        eviction=run.eviction if alone else None,
                        prefix_caching=not alone or bool(run.evicts and (run.eviction.share_context
                                                                         or run.eviction.chain)))
        try:
            started = time.perf_counter()
            results, engine_ids = generate_shared(engine, prompts, cells, progress=terminal)
            wall = time.perf_counter() - started
            check_no_failures(works, results)
            ledger, facts, vllm_version = engine.ledger(), engine.facts(), engine.vllm_version
            per_request = engine.request_counters([rid for row in engine_ids for rid in row])
            likelihood = cells_likelihood(engine, works, terminal) if run.likelihood else [None] * len(works)
        finally:
            engine.close()
    shared = None if alone else {"cells": len(works), "prompts": len(prompts), "prefix_caching": True,
                                 "group_wall_s": wall, "group_kv": ledger}
    full = next((slot for slot, work in enumerate(works) if not work.run.evicts), None)
    full_rows = None
    records: list[CellRecord | None] = [None] * len(works)
    for slot in ([full] if full is not None else []) + [s for s in range(len(works)) if s != full]:
        work = works[slot]
        requests = [per_request.get(row[slot]) for row in engine_ids]
        records[slot] = record_cell(
            work, [row[slot] for row in results], wall, facts,
            ledger if alone else cell_kv(ledger, work.run, requests), vllm_version, shared,
            evictions=[dict(r["evictions"]) if r else None for r in requests] if work.run.evicts else None,
            likelihood=likelihood[slot], full_rows=full_rows)
        if slot == full:
            full_rows = records[slot].rows
    return records  # type: ignore[return-value]


class PolicyFailedError(RuntimeError):
    """A cell's policy failed on some of its requests: the engine ended them with an error."""


def check_no_failures(works: list[CellWork], results: list[list]) -> None:
    """A cell whose policy failed on any request has no result: the group stops with the message
    and nothing of it is published (the engine itself went on serving the other requests)."""
    for slot, work in enumerate(works):
        errors = [row[slot].error for row in results if row[slot] is not None and row[slot].error]
        if errors:
            raise PolicyFailedError(f"{work.run.label} failed on {len(errors)} of {len(results)} prompts: {errors[0]}")


def keep_engine_log(log: Path, target: Path) -> None:
    """A failed run leaves vLLM's log beside where the run would have gone, its tail on the terminal."""
    if log.exists():
        kept_log = target.with_name(target.name + ".failed.log")
        log.replace(kept_log)
        print(f"[engine] the last lines of vLLM's log ({kept_log}):\n{tail(kept_log)}", file=sys.stderr)


def check_same_prompts(works: list[CellWork]) -> None:
    first = works[0]
    for work in works[1:]:
        if work.token_ids != first.token_ids or [s.id for s in work.samples] != [s.id for s in first.samples]:
            raise RuntimeError(f"cells {first.target.name} and {work.target.name} were grouped but their prompts differ")


def cell_kv(ledger: dict | None, run: RunSettings, requests: list[dict | None]) -> dict | None:
    """One cell's eviction ledger: the shared engine's ledger with its counters replaced by the sum
    of this cell's requests' (``EvictionCounters.over``); the memory figures (pool, peaks) and the
    reconstruction passes' figures (KVzip's, counted per step, not per request) stay the whole
    group's, and ``shared_figures`` names them."""
    if ledger is None:
        return None
    return {
        **ledger,
        **EvictionCounters.over(requests).counts(),
        "policy": run.policy if run.evicts else None,
        "budget": run.budget if run.evicts else None,
        "budget_ratio": run.budget_ratio if run.evicts else None,
        "decode_eviction": run.decode_eviction,
        "shared_figures": ["kv_pool_blocks", "steps", "kv_blocks_used_peak", "kv_blocks_used_mean",
                           "running_requests_peak", "decode_blocks_peak", "model_s", "evict_share_of_step",
                           *(["shared_contexts"] if "shared_contexts" in ledger else []),
                           *[key for key in ("reconstruct_s", "reconstruct_tokens", "reconstruct_reused") if key in ledger]],
    }

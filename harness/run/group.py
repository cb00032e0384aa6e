"""A sweep's cells that share model, data and engine settings, run on one engine.

Every prompt is prefilled once (``harness.engine.shared_prefill``) and each cell's request for it
carries the cell's own eviction settings. Each cell still gets its own complete run directory,
the same files and layout as a cell run alone, published atomically (full cache first: the other
cells' fidelity is measured against it); complete cells are skipped, so a killed group sweep
resumes where it stopped. Timings are labelled as shared (``perf.json`` ``isolated: false``).
"""
from __future__ import annotations

import json
import time
from collections import defaultdict

from harness.config import RunSettings
from harness.records.console import engine_output_to
from harness.eviction.counters import EvictionCounters
from harness.run.likelihood import cells_likelihood
from harness.run.cell import ENGINE_LOG, CellWork, keep_engine_log, prepare_cell, publish_cell
from harness.config.models import resolve_model_path
from harness.records.results import RunWriter

SHARED_KEYS = ("model", "data", "engine", "block_size", "seed", "output_dir", "likelihood")


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

    model_path = resolve_model_path(runs[0].model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    works = [work for work in (prepare_cell(run, tokenizer) for run in runs) if work is not None]
    if not works:
        return {}
    works.sort(key=lambda work: work.run.evicts)  # full cache publishes first
    check_same_prompts(works)
    from harness.engine.llm import Engine
    from harness.engine.shared_prefill import CellRequest, generate_shared

    prompts = works[0].token_ids
    cells = [[CellRequest(work.run.eviction, work.max_new_tokens[i], work.stops[i]) for work in works]
             for i in range(len(prompts))]
    writers = [RunWriter(work.target) for work in works]
    log = writers[0].partial / ENGINE_LOG
    run = works[0].run
    print(f"[engine] starting vLLM for {name}: {len(works)} cells ({', '.join(w.run.label for w in works)}) x "
          f"{len(prompts)} prompts, each prompt prefilled once (its log: {works[0].target / ENGINE_LOG})", flush=True)
    try:
        with engine_output_to(log) as terminal:
            engine = Engine(model_path, run.model, run.engine, run.block_size, seed=run.seed, prefix_caching=True)
            try:
                started = time.perf_counter()
                results, engine_ids = generate_shared(engine, prompts, cells, progress=terminal)
                wall = time.perf_counter() - started
                ledger, facts, vllm_version = engine.ledger(), engine.facts(), engine.vllm_version
                per_request = engine.request_counters([rid for row in engine_ids for rid in row])
                likelihood = cells_likelihood(engine, works, terminal) if run.likelihood else [None] * len(works)
            finally:
                engine.close()
        shared = {"cells": len(works), "prompts": len(prompts), "prefix_caching": True, "group_wall_s": wall,
                  "group_kv": ledger}
        outcome = {}
        for slot, (work, writer) in enumerate(zip(works, writers)):
            cell_results = [row[slot] for row in results]
            requests = [per_request.get(row[slot]) for row in engine_ids]
            cell_ledger = cell_kv(ledger, work.run, requests)
            if slot:  # the engine log went into the first cell's directory
                writer.write_text(ENGINE_LOG, f"shared engine: see {works[0].target / ENGINE_LOG}\n")
            evictions = [dict(r["evictions"]) if r else None for r in requests] if work.run.evicts else None
            publish_cell(work, writer, cell_results, wall, facts, cell_ledger, vllm_version, shared,
                         evictions=evictions, likelihood=likelihood[slot])
            outcome[str(work.target)] = "done"
        return outcome
    except BaseException:
        keep_engine_log(log, works[0].target)
        for writer in writers:
            writer.abandon()
        raise


def check_same_prompts(works: list[CellWork]) -> None:
    first = works[0]
    for work in works[1:]:
        if work.token_ids != first.token_ids or [s.id for s in work.samples] != [s.id for s in first.samples]:
            raise RuntimeError(f"cells {first.target.name} and {work.target.name} were grouped but their prompts differ")


def cell_kv(ledger: dict | None, run: RunSettings, requests: list[dict | None]) -> dict | None:
    """One cell's eviction ledger from its requests' counters, beside the shared engine's memory
    figures (pool, peaks: those are the whole group's)."""
    if ledger is None:
        return None
    totals = EvictionCounters.total(EvictionCounters.of(r) for r in requests if r is not None).counts()
    cell = dict(ledger)
    cell.update(totals)
    cell.update({
        "policy": run.policy if run.evicts else None,
        "budget": run.budget if run.evicts else None,
        "budget_ratio": run.budget_ratio if run.evicts else None,
        "decode_eviction": run.decode_eviction,
        "shared_figures": ["kv_pool_blocks", "steps", "kv_blocks_used_peak", "kv_blocks_used_mean",
                           "running_requests_peak", "decode_blocks_peak", "model_s", "evict_share_of_step"],
    })
    return cell

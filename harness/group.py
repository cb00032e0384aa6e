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

from omegaconf import DictConfig, OmegaConf

from harness.config import run_dir
from harness.console import engine_output_to
from harness.experiment import ENGINE_LOG, CellWork, keep_engine_log, label, prepare_cell, publish_cell
from harness.models import resolve_model_path
from harness.results import RunWriter

SHARED_KEYS = ("model", "data", "engine", "block_size", "seed", "output_dir")


def group_key(cfg: DictConfig) -> str:
    """Cells with the same key can share one engine: they differ only in policy and budget."""
    return json.dumps({key: OmegaConf.to_container(cfg, resolve=True).get(key) for key in SHARED_KEYS},
                      sort_keys=True, default=str)


def eviction_of(cfg: DictConfig):
    from harness.engine.settings import EvictionSettings, policy_options

    if cfg.policy.name == "full":
        return None
    return EvictionSettings(cfg.policy.name, cfg.budget, policy_options(cfg))


def run_grouped(cfgs: list[DictConfig]) -> list[str]:
    """Run every cell, one engine per group; returns "done" or "skipped" per cell, in order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index, cfg in enumerate(cfgs):
        groups[group_key(cfg)].append(index)
    outcome = ["skipped"] * len(cfgs)
    started = time.perf_counter()
    for number, members in enumerate(groups.values(), 1):
        distinct: dict[str, int] = {}
        for index in members:  # full cache appears once per budget in a sweep: one run directory
            distinct.setdefault(str(run_dir(cfgs[index])), index)
        done = run_group([cfgs[i] for i in distinct.values()], f"group {number}/{len(groups)}")
        for index in members:
            outcome[index] = done.get(str(run_dir(cfgs[index])), "skipped")
        print(f"[sweep] group {number}/{len(groups)} finished | elapsed {time.perf_counter() - started:.0f}s",
              flush=True)
    return outcome


def run_group(cfgs: list[DictConfig], name: str) -> dict[str, str]:
    """One engine for cells differing only in policy and budget; returns run dir -> outcome."""
    from transformers import AutoTokenizer

    model_path = resolve_model_path(str(cfgs[0].model.path))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    works = [work for work in (prepare_cell(cfg, tokenizer) for cfg in cfgs) if work is not None]
    if not works:
        return {}
    works.sort(key=lambda work: work.cfg.policy.name != "full")  # full cache publishes first
    check_same_prompts(works)
    from harness.engine.llm import Engine
    from harness.engine.shared_prefill import CellRequest, generate_shared

    prompts = works[0].token_ids
    cells = [[CellRequest(eviction_of(work.cfg), work.max_new_tokens[i], work.stops[i]) for work in works]
             for i in range(len(prompts))]
    writers = [RunWriter(work.target) for work in works]
    log = writers[0].partial / ENGINE_LOG
    cfg = works[0].cfg
    print(f"[engine] starting vLLM for {name}: {len(works)} cells ({', '.join(label(w.cfg) for w in works)}) x "
          f"{len(prompts)} prompts, each prompt prefilled once (its log: {works[0].target / ENGINE_LOG})", flush=True)
    try:
        with engine_output_to(log) as terminal:
            engine = Engine(model_path, cfg.model, cfg.engine, cfg.block_size, seed=cfg.get("seed", 0),
                            prefix_caching=True)
            try:
                started = time.perf_counter()
                results, engine_ids = generate_shared(engine, prompts, cells, progress=terminal)
                wall = time.perf_counter() - started
                ledger, facts, vllm_version = engine.ledger(), engine.facts(), engine.vllm_version
                stats = engine.request_stats([rid for row in engine_ids for rid in row])
            finally:
                engine.close()
        shared = {"cells": len(works), "prompts": len(prompts), "prefix_caching": True, "group_wall_s": wall,
                  "group_kv": ledger}
        outcome = {}
        for slot, (work, writer) in enumerate(zip(works, writers)):
            cell_results = [row[slot] for row in results]
            cell_ledger = cell_kv(ledger, work.cfg, [stats.get(row[slot]) for row in engine_ids])
            if slot:  # the engine log went into the first cell's directory
                writer.write_text(ENGINE_LOG, f"shared engine: see {works[0].target / ENGINE_LOG}\n")
            publish_cell(work, writer, cell_results, wall, facts, cell_ledger, vllm_version, shared)
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


def cell_kv(ledger: dict | None, cfg: DictConfig, requests: list[dict | None]) -> dict | None:
    """One cell's eviction ledger from its requests' stats, beside the shared engine's memory
    figures (pool, peaks: those are the whole group's)."""
    if ledger is None:
        return None
    present = [r for r in requests if r is not None]
    cell = dict(ledger)
    cell.update({
        "policy": None if cfg.policy.name == "full" else cfg.policy.name,
        "budget": None if cfg.policy.name == "full" else cfg.budget,
        "evictions": {phase: sum(r["evictions"][phase] for r in present) for phase in ("prefill", "decode")},
        "freed_blocks": sum(r["freed_blocks"] for r in present),
        "evicted_tokens": sum(r["evicted_tokens"] for r in present),
        "copied_tokens": {phase: sum(r["copied_tokens"][phase] for r in present) for phase in ("prefill", "decode")},
        "copy_target_blocks": sum(r["copy_target_blocks"] for r in present),
        "evict_s": sum(r["evict_s"] for r in present),
        "preempted_after_eviction": sum(r["preempted_after_eviction"] for r in present),
        "shared_figures": ["kv_pool_blocks", "steps", "kv_blocks_used_peak", "kv_blocks_used_mean",
                           "running_requests_peak", "decode_blocks_peak", "model_s", "evict_share_of_step"],
    })
    return cell

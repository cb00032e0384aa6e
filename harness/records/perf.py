"""A run's ``perf.json``: throughput, latency percentiles and the facts needed to compare runs."""
from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    position = (len(values) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def distribution(values: list[float]) -> dict:
    present = [v for v in values if v is not None]
    return {
        "p50": percentile(present, 50),
        "p90": percentile(present, 90),
        "mean": statistics.fmean(present) if present else None,
    }


def kv_memory(ledger: dict | None, facts: dict) -> dict | None:
    """Blocks in use in vLLM's pool (peak, mean, and in bytes) and what eviction cost."""
    if ledger is None:
        return None  # the engine core ran in another process: its scheduler is not readable here
    block_bytes = facts["kv_pool_bytes"] / facts["kv_pool_blocks"] if facts.get("kv_pool_bytes") else None
    memory = dict(ledger)
    if block_bytes:
        memory["kv_bytes_used_peak"] = ledger["kv_blocks_used_peak"] * block_bytes
        memory["kv_bytes_used_mean"] = ledger["kv_blocks_used_mean"] * block_bytes
    return memory


SHARED_TIMINGS = ("measured on an engine shared with other cells (prompts prefilled once, requests of every "
                  "cell batched together): not comparable with an isolated run's; use the throughput benchmark")


def summarize_perf(results, wall_s: float, facts: dict, ledger: dict | None = None, shared: dict | None = None) -> dict:
    """``shared``: how this cell shared its engine (None: it had the engine to itself); its
    timings are then labelled as not isolated."""
    output_tokens = sum(r.output_tokens for r in results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return {
        "isolated": shared is None,
        "shared_engine": {**shared, "note": SHARED_TIMINGS} if shared is not None else None,
        "requests": len(results),
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall_s,
        "requests_per_s": len(results) / wall_s,
        "ttft_s": distribution([r.ttft_s for r in results]),
        "tpot_s": distribution([r.tpot_s for r in results]),
        "latency_s": distribution([r.latency_s for r in results]),
        "preemptions": sum(r.preemptions or 0 for r in results),
        "kv": kv_memory(ledger, facts),
        "machine": facts,
    }

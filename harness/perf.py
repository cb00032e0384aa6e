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


def summarize_perf(results, wall_s: float, facts: dict) -> dict:
    output_tokens = sum(r.output_tokens for r in results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return {
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
        "preemptions": sum(r.preemptions for r in results),
        "machine": facts,
    }

"""The tiny throughput setting both benchmark test files use (tests/experiments/test_throughput.py,
tests/engine/test_throughput.py): four requests of 96 prompt tokens growing by 416, a pool for one
of them at full length, full cache against PagedEviction at 64 tokens and the unlimited ceiling."""
from __future__ import annotations

from harness.bench.throughput import Cell, Setting, Workload

TINY = Workload(requests=4, prompt_tokens=96, output_tokens=416, model="embedded:tiny-llama")
FULL, PAGED, CEILING = Cell("full"), Cell("paged", 64), Cell("full", pool="unlimited")


def setting(*cells, workload=TINY) -> Setting:
    return Setting("tiny", "test", workload, cells, fixed_pool_requests=1, baseline=FULL, ceiling=CEILING)

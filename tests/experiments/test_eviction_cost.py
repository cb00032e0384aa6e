"""The eviction microbenchmark measures what it says (a small case, this tree's evictor only)."""
from __future__ import annotations

import importlib.util

from tests.support import ROOT


def load_benchmark():
    spec = importlib.util.spec_from_file_location("eviction_cost", ROOT / "experiments" / "eviction_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_steady_state_block_eviction_allocates_less_than_one_layer_of_the_request():
    """PagedEviction at budget 1024 on SmolLM2's shape: the measured peak of extra memory stays
    below one layer's K/V of the request (the old evictor copied every layer, in float32)."""
    benchmark = load_benchmark()
    case = dict(shape="smollm2-135m", policy="paged", phase="decode", budget=1024, tokens=1024 + benchmark.BLOCK)
    result = benchmark.run_case(case, ROOT)
    shape = benchmark.SHAPES["smollm2-135m"]
    one_layer = case["tokens"] * shape["heads"] * shape["dim"] * 2 * 4
    assert result["score_cache"] and result["evictor"].startswith(str(ROOT))
    assert 0 <= result["extra_bytes"] < one_layer, result


def test_the_peak_measurement_sees_a_temporary(tmp_path):
    """The VmHWM reading catches a 64 MiB temporary freed before it is read."""
    import os
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from pathlib import Path\nimport torch\nfrom eviction_cost import status_bytes\n"
        # torch's first fill starts its thread pool: warm it up so only the temporary is measured.
        "torch.ones(2**10).sum()\n"
        "Path('/proc/self/clear_refs').write_text('5'); before = status_bytes('VmHWM')\n"
        "t = torch.ones(16 * 2**20); del t\nprint(status_bytes('VmHWM') - before)\n"
    ) % str(ROOT / "experiments")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    assert done.returncode == 0, done.stderr
    assert 60 * 2**20 <= int(done.stdout.strip()) <= 70 * 2**20

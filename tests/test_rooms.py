"""Rooms by what they know: policies and the eviction core never import vLLM (a vLLM upgrade
touches harness/engine/ only), and the core never reaches into the vLLM glue."""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def modules_of(package: str) -> list[str]:
    path = ROOT.joinpath(*package.split("."))
    return [package] + [f"{package}.{info.name}" for info in pkgutil.iter_modules([str(path)])]


@pytest.mark.parametrize("package", ["policies", "harness.eviction"])
def test_a_vllm_free_room_imports_no_vllm_and_no_engine_glue(package):
    imports = "; ".join(f"import {name}" for name in modules_of(package))
    probe = (f"import sys; {imports}; "
             "print(sorted({m.split('.')[0] for m in sys.modules if m == 'vllm' or m.startswith('vllm.')}), "
             "sorted(m for m in sys.modules if m.startswith('harness.engine')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[] []", f"{package} pulled in: {done.stdout}"


def test_every_module_that_imports_vllm_lives_in_the_engine_package():
    importers = sorted(
        str(path.relative_to(ROOT)) for folder in ("harness", "policies", "hydra_plugins")
        for path in (ROOT / folder).rglob("*.py")
        if any(line.lstrip().startswith(("import vllm", "from vllm")) for line in path.read_text().splitlines())
    )
    assert importers and all(path.startswith("harness/engine/") for path in importers), importers

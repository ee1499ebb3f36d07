#!/usr/bin/env bash
# The SGLang contract environment: each supported release's Python package (--no-deps) plus the
# pure-Python packages its request types, argument parser and process-group helper import, pinned;
# GPU-only modules are stand-ins (tools/contract/stand_ins.py). Built once under
# .cache/sglang-contract/ (a stamp per piece), then reused. Prints the directory.
#   usage: tools/contract/build_env.sh [VENV_PYTHON]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
ROOT=.cache/sglang-contract
# the oldest and the newest release of the supported window (agent_r1/weights/sglang.py)
RELEASES=(0.5.6 0.5.23)
DEPS=(pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1 dill==0.4.1
      sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0
      partial-json-parser==0.2.1.1.post7)
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile)
mkdir -p "$ROOT"
key=$(printf '%s\n' "${DEPS[@]}" | sha256sum | cut -c1-16)
if [[ "$(cat "$ROOT/deps/.stamp" 2>/dev/null)" != "$key" ]]; then
  rm -rf "$ROOT/deps"
  "${PIP[@]}" --target "$ROOT/deps" "${DEPS[@]}" >&2
  echo "$key" > "$ROOT/deps/.stamp"
fi
for v in "${RELEASES[@]}"; do
  if [[ ! -f "$ROOT/sglang-$v/.stamp" ]]; then
    rm -rf "$ROOT/sglang-$v"
    "${PIP[@]}" --target "$ROOT/sglang-$v" "sglang==$v" >&2
    echo "$v" > "$ROOT/sglang-$v/.stamp"
  fi
done
echo "$ROOT"

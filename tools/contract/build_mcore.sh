#!/usr/bin/env bash
# The newest megatron-core for the CPU learner tests: 0.17+ declare Python >= 3.12 but import on
# 3.11, so it is installed --no-deps --ignore-requires-python into .cache/megatron-core-$V/ (once,
# a stamp), with a sitecustomize that stands in for triton (imported by its MoE kernels at import
# time, never run on CPU; the real wheel is 1 GB). Prints the directory to put first on PYTHONPATH.
#   usage: tools/contract/build_mcore.sh [VENV_PYTHON]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
V=0.19.2  # the newest release (2026-09); the venv holds 0.16.1, the newest whose metadata allows 3.11
DIR=.cache/megatron-core-$V
if [[ "$(cat "$DIR/.stamp" 2>/dev/null)" != "$V" ]]; then
  rm -rf "$DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --ignore-requires-python \
    --target "$DIR" "megatron-core==$V" >&2
  cat > "$DIR/sitecustomize.py" <<PYEOF
import os, sys
os.environ.setdefault("AGENT_R1_STAND_INS", "triton")
sys.path.insert(0, "$(pwd)/tools/contract")
import stand_ins  # noqa: E402,F401
PYEOF
  echo "$V" > "$DIR/.stamp"
fi
echo "$DIR"

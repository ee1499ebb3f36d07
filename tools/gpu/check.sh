#!/usr/bin/env bash
# The prepared GPU check: one CUDA GPU, PyTorch present, nothing fetchable. Installs the carried
# wheels (tools/gpu/wheels/, made by tools/gpu/fetch_wheels.sh) when they are there, then runs
# tools/gpu/check.py within 10 minutes: bridge parity in bf16, a learner PPO update from a
# LearnerBatch, the embedded engine generating, a CUDA IPC weight push to a server on the same GPU.
# Prints PASS/FAIL per check and BENCH lines; writes gpu_check.json ($OUT/ when set).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [[ -d tools/gpu/wheels ]]; then
  "$PY" -m pip install -q --no-index --find-links tools/gpu/wheels -r tools/gpu/requirements.txt \
    || echo "[gpu check] some wheels did not install; going on with what is there"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
timeout 580 "$PY" tools/gpu/check.py --out "${OUT:-.}/gpu_check.json" "$@"

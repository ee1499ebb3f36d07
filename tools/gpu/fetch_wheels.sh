#!/usr/bin/env bash
# Download the wheels tools/gpu/check.sh needs on a GPU machine with nothing fetchable (CPython 3.12,
# x86_64 Linux; PyTorch itself is the machine's own) into tools/gpu/wheels/, to carry there.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
  -d wheels -r requirements.txt --no-deps
# pure-Python dependencies of the above (no torch, no CUDA packages)
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps -d wheels \
  multidict yarl frozenlist aiosignal attrs propcache aiohappyeyeballs idna charset-normalizer urllib3 \
  certifi typing-extensions fsspec tqdm
du -sh wheels

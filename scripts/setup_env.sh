#!/usr/bin/env bash
# Creates .venv (if missing) and installs batchgen into it with the extras given as $1, under
# the pinned versions CI passed with (scripts/constraints.txt; BATCHGEN_UNPINNED=1 takes the
# newest each range allows instead). Torch: a CPU build is taken unless torch is already in the
# venv (set TORCH_SPEC to change it).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
pins="-c scripts/constraints.txt"
[ "${BATCHGEN_UNPINNED:-0}" = 1 ] && pins=""
if [ -n "$extras" ]; then
  python -m pip install -q $pins -e ".[$extras]"
else
  python -m pip install -q $pins -e .
fi
if [[ ",$extras," == *,test,* ]]; then
  # FlashInfer's Python layer for tests/test_flashinfer_real.py: without its dependencies (they
  # are CUDA wheels); it imports on a CPU with these two. The upper end of the [cuda] range.
  python -m pip install -q $pins --no-deps "flashinfer-python==0.7.4" \
    "apache-tvm-ffi>=0.1.11,<0.2" "nvidia-ml-py"
fi

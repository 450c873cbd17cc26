#!/usr/bin/env bash
# Installs batchgen with its test extras into .venv, then runs the test suite (pytest).
# The [test] extra is complete (CI runs every test): Ray, lm-eval, matplotlib, xgrammar (which
# pulls triton on Linux x86-64), then FlashInfer's Python layer; .venv ends near 4 GB, and the
# whole suite takes 11-15 minutes on a 2-core machine. BATCHGEN_LEAN_TESTS=1 installs only
# [test-core] (pytest, hypothesis; ~1.3 GiB in all): the tests that need the others skip.
# Arguments go to pytest: `bash scripts/test.sh tests/test_dataset.py -x` runs one file.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=test
if [ "${BATCHGEN_LEAN_TESTS:-0}" = 1 ]; then
  extras=test-core
fi
bash scripts/setup_env.sh "$extras"
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m pytest -q "$@"

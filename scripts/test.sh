#!/usr/bin/env bash
# Installs batchgen with its test extras into .venv, then runs the test suite (pytest).
# The [test] extra is complete (CI runs every test): Ray, lm-eval, matplotlib, xgrammar (which
# pulls triton on Linux x86-64), then FlashInfer's Python layer; .venv ends near 4 GB, and the
# whole suite takes 8-9 minutes on a 2-core machine in two pytest-xdist workers (a file stays
# on one worker, so its module fixtures are built once; BATCHGEN_TEST_WORKERS=1: one process).
# BATCHGEN_LEAN_TESTS=1 installs only [test-core] (pytest, hypothesis; ~1.3 GiB in all): the tests that need the others skip.
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
workers="${BATCHGEN_TEST_WORKERS:-2}"
if [ "$workers" -gt 1 ]; then
  python -m pytest -q -n "$workers" --dist loadfile "$@"
else
  python -m pytest -q "$@"
fi

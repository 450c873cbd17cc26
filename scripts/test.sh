#!/usr/bin/env bash
# Installs batchgen with its test extras into .venv, then runs the test suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m pytest -q "$@"

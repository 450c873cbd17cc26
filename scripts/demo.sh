#!/usr/bin/env bash
# The main job end to end, offline: install, write a random tiny model with a real byte-level
# BPE tokenizer, then generate from it with batchgen (greedy, n samples, stop strings).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m batchgen.tools.make_tiny_model models/tiny-llama --eos-boost 0.06
python examples/quickstart.py models/tiny-llama

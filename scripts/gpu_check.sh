#!/usr/bin/env bash
# One prepared run for a machine with a GPU (the device tool): CUDA tests, then the throughput
# benchmark on the GPU, printing a short table. Uses the torch and transformers already there.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
python -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tail -15
python benchmarks/throughput.py --device cuda --repeats 2 --num-prompts 64 --hidden-size 1024 \
  --num-layers 8 --num-heads 16 --num-kv-heads 4 --intermediate-size 2816 --skip-generate-batch \
  "$@" 2>&1 | grep -E '^\||x$|machine'

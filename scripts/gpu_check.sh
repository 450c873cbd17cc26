#!/usr/bin/env bash
# One prepared run for a machine with a GPU (the device tool): CUDA tests, then the throughput
# benchmark on the GPU, printing a short table. Uses the torch and transformers already there.
# Exits non-zero when any step fails (full logs under $OUT when it is set).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
logs="${OUT:-$(mktemp -d)}"
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
python -m pytest -q -m cuda tests/test_cuda.py > "$logs/gpu_tests.log" 2>&1 || status=1
tail -15 "$logs/gpu_tests.log"
python benchmarks/throughput.py --device cuda --repeats 2 --num-prompts 64 --hidden-size 1024 \
  --num-layers 8 --num-heads 16 --num-kv-heads 4 --intermediate-size 2816 --skip-generate-batch \
  "$@" > "$logs/gpu_throughput.log" 2>&1 || status=1
grep -E '^\||x$|machine' "$logs/gpu_throughput.log" || tail -20 "$logs/gpu_throughput.log"
[ "$status" -eq 0 ] && echo "gpu_check: all steps passed" || echo "gpu_check: a step FAILED (logs: $logs)"
exit "$status"

#!/usr/bin/env bash
# The one prepared run for a GPU host (the `device` tool), under 8 minutes: FlashInfer from the
# offline bundle when the host lacks it, the GPU tests, then the GPU benchmark (issue 9's bar)
# and the host overhead per decode step on CUDA (issue 17), then async scheduling on CUDA (issue
# 33: serial vs async steps of the random model, same tokens asserted; the GPU tests include its
# bit-for-bit check), printing short tables; on a host with
# two or more GPUs also tensor parallelism, TP=1 vs TP=2 (issue 19, at most 2 more minutes;
# skipped with one line otherwise). Full logs go to $OUT when it is set. Exits non-zero if a step fails.
#
# Here, once (the folder stays out of git):
#   bash ../shared/tools/flashinfer-offline-bundle.sh flashinfer-bundle 0.7.4 312
# Then: device run, carry ["flashinfer-bundle"], command "bash scripts/gpu_check.sh".
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
logs="${OUT:-$(mktemp -d)}"
status=0
if ! python3 -c "import flashinfer" 2>/dev/null; then
  if ls flashinfer-bundle/flashinfer-*.tar.xz >/dev/null 2>&1; then
    site=$PWD/flashinfer-bundle/site
    mkdir -p "$site" && tar -xJf flashinfer-bundle/flashinfer-*.tar.xz -C "$site" &&
      python3 -m pip install -q --no-index --no-deps --target "$site" \
        flashinfer-bundle/apache_tvm_ffi-*.whl || status=1
    # FlashInfer JIT-compiles every kernel with nvcc: without it CUDA_HOME would become "."
    nvcc_bin=$(command -v nvcc || true)
    if [ -z "$nvcc_bin" ] && [ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]; then
      nvcc_bin=$CUDA_HOME/bin/nvcc
    fi
    if [ -z "$nvcc_bin" ]; then
      echo "gpu_check: FAILED: nvcc not found (not on PATH, nor \$CUDA_HOME/bin/nvcc);" \
        "FlashInfer compiles its kernels with it: put the CUDA toolkit's bin/ on PATH" >&2
      exit 1
    fi
    nvcc_root=$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")
    export PYTHONPATH=$site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=$PWD/flashinfer-bundle/jit \
      MAX_JOBS=16 FLASHINFER_NO_DOWNLOAD=1 CUDA_HOME=$nvcc_root \
      FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
  else
    echo "gpu_check: no flashinfer here and no flashinfer-bundle/ carried (see the header)"
    status=1
  fi
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || status=1
timeout 270 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py \
  tests/test_cuda_flashinfer.py tests/test_cuda_flashinfer_mla.py > "$logs/gpu_tests.log" 2>&1 || status=1
tail -20 "$logs/gpu_tests.log"
# A step's tables when it passed; the tail of its log (the traceback) when it failed.
if timeout 230 python3 benchmarks/gpu_bench.py --json "$logs/gpu_bench.json" \
  > "$logs/gpu_bench.log" 2>&1; then
  sed -n '/^model:/p; /^| system/,$p' "$logs/gpu_bench.log"
else
  rc=$?; status=1; echo "gpu_check: gpu_bench FAILED (rc $rc); the end of its log:"
  tail -30 "$logs/gpu_bench.log"
fi
if timeout 90 python3 benchmarks/host_overhead.py --device cuda --long-tokens 0 \
  --json "$logs/host_overhead.json" > "$logs/host_overhead.log" 2>&1; then
  sed -n '/^| system/,$p' "$logs/host_overhead.log"
else
  rc=$?; status=1; echo "gpu_check: host_overhead FAILED (rc $rc); the end of its log:"
  tail -20 "$logs/host_overhead.log"
fi
# Beams, 64 prompts x W=4: host ms per step early and late (the real forward, stubbed, stubbed
# reading the K/V's bytes), function calls per step, HF's own host ms.
if timeout 150 python3 benchmarks/host_overhead.py --device cuda --beams --repeats 2 \
  --json "$logs/host_beams.json" > "$logs/host_beams.log" 2>&1; then
  sed -n '/^| system/,$p' "$logs/host_beams.log"
else
  rc=$?; status=1; echo "gpu_check: host_overhead --beams FAILED (rc $rc); the end of its log:"
  tail -20 "$logs/host_beams.log"
fi
if timeout 120 python3 benchmarks/host_overhead.py --device cuda --overlap --overlap-model \
  --rows 64,256 --repeats 2 --json "$logs/overlap.json" > "$logs/overlap.log" 2>&1; then
  sed -n '/^| model forward/,$p' "$logs/overlap.log"
else
  rc=$?; status=1; echo "gpu_check: host_overhead --overlap FAILED (rc $rc); the end of its log:"
  tail -20 "$logs/overlap.log"
fi
# A hybrid (Gated DeltaNet + attention): greedy agreement with HF and tok/s, greedy/n=8/beams.
if timeout 150 python3 benchmarks/hybrid.py --device cuda --num-prompts 64 --output-len 32 \
  --json "$logs/hybrid.json" > "$logs/hybrid.log" 2>&1; then
  sed -n '/^model:/p; /^greedy agreement/p; /^| workload/,$p' "$logs/hybrid.log"
else
  rc=$?; status=1; echo "gpu_check: hybrid FAILED (rc $rc); the end of its log:"
  tail -20 "$logs/hybrid.log"
fi
# Tensor parallelism needs a GPU per rank: a 600M-parameter Llama in bf16, TP=1 vs TP=2.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -ge 2 ]; then
  if timeout 120 python3 benchmarks/tensor_parallel.py --device cuda --tp 1,2 --repeats 2 \
    --hidden-size 2048 --num-layers 8 --num-heads 32 --num-kv-heads 8 --intermediate-size 8192 \
    --vocab-size 32000 --dtype bfloat16 --num-prompts 128 --min-prompt-len 64 \
    --max-prompt-len 256 --output-len 64 --json "$logs/tensor_parallel.json" \
    > "$logs/tensor_parallel.log" 2>&1; then
    sed -n '/^model:/p; /^| TP/,$p' "$logs/tensor_parallel.log"
  else
    rc=$?; status=1; echo "gpu_check: tensor_parallel FAILED (rc $rc); the end of its log:"
    tail -30 "$logs/tensor_parallel.log"
  fi
else
  echo "gpu_check: tensor parallel skipped (fewer than 2 GPUs: ${gpus:-0} listed by nvidia-smi -L)"
fi
[ "$status" -eq 0 ] && echo "gpu_check: all steps passed" || echo "gpu_check: a step FAILED (logs: $logs)"
exit "$status"

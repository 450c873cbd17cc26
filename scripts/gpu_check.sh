#!/usr/bin/env bash
# The one prepared run for a GPU host (the `device` tool), inside a deadline (GPU_CHECK_BUDGET
# seconds, default 540): the carried packages and FlashInfer from the offline bundle when the
# host lacks them; every FlashInfer kernel module the later steps use, built several at once
# (scripts/gpu_warmup.py); the GPU tests; the GPU benchmark (issue 9's bar); a hybrid model;
# the host overhead per decode step on CUDA (issue 17), for beams, and async scheduling (issue
# 33); on a host with two or more GPUs also tensor parallelism, TP=1 vs TP=2 (issue 19);
# quantized checkpoints (issue 41); vision-language models (issue 40, gpu_vlm). Steps
# run in that order, most valuable first; a step that would start with too little time left is
# skipped with one line. Short tables are printed; every log is packed after each step into
# $OUT/gpu_logs.tar.gz (when OUT is set), so a run cut short still returns what it did.
# Exits non-zero if a step fails.
#
# First run (2026-12-04, one H200, 16 cores; 15 device minutes in all, machine start ~30 s):
# the warm-up built its 10 modules in 113-126 s; the 1.5B benchmark's batchgen runs took 37 s
# eager and 17 s with graphs, and its HF baselines did not finish in the 150 s left to it;
# the rest did not fit. gpu_bench now gets 240 s (HF's baselines: 128 prompts of up to 512
# tokens through generate, 512 through generate_batch, which compiles on CUDA). A session gets
# through warm-up + tests + gpu_bench in one lease: choose later steps with GPU_CHECK_STEPS
# (e.g. "gpu_warmup hybrid host_overhead host_beams overlap").
#
# Here, once (both folders stay out of git):
#   bash ../shared/tools/flashinfer-offline-bundle.sh flashinfer-bundle 0.7.4 312
#   bash scripts/gpu_wheels.sh     # the pinned transformers and what it needs, for Python 3.12
# Then: device run, carry ["flashinfer-bundle", ".whl"], command "bash scripts/gpu_check.sh".
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
start=$SECONDS
budget=${GPU_CHECK_BUDGET:-540}
logs=$(mktemp -d)
status=0
site=$PWD/flashinfer-bundle/site
mkdir -p "$site"
pack() { [ -n "${OUT:-}" ] && tar -czf "$OUT/gpu_logs.tar.gz" -C "$logs" . 2>/dev/null; true; }
# step NAME LIMIT CMD...: runs CMD into $logs/NAME.log under min(LIMIT, the time left), or
# skips it when under 45 s are left (0) or when GPU_CHECK_STEPS names other steps (1).
# Returns CMD's status.
step() {
  local name=$1 limit=$2; shift 2
  case " ${GPU_CHECK_STEPS:-$name} " in *" $name "*) ;; *) return 1 ;; esac
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 45 ]; then
    echo "gpu_check: $name skipped ($left s of the ${budget} s budget left)"; return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1 || rc=$?
  echo "gpu_check: $name: rc $rc in $((SECONDS - t0)) s (limit $limit s)"
  [ "$rc" -ne 0 ] && { status=1; echo "gpu_check: $name FAILED; the end of its log:"; tail -30 "$logs/$name.log"; }
  pack
  return "$rc"
}
# The pinned transformers (and its needs) when .whl/ is carried: the versions CI tests with.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl ||
    status=1
  export PYTHONPATH=$site:$PYTHONPATH
fi
if ! python3 -c "import flashinfer" 2>/dev/null; then
  if ls flashinfer-bundle/flashinfer-*.tar.xz >/dev/null 2>&1; then
    tar -xJf flashinfer-bundle/flashinfer-*.tar.xz -C "$site" &&
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
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
} 2>&1 | tee "$logs/env.log"
python3 -c "import flashinfer" 2>/dev/null || status=1
# Every kernel module at once (10 processes, 3 nvcc each on a 16-core host): the tests load them.
step gpu_warmup 200 env MAX_JOBS=3 python3 scripts/gpu_warmup.py --jobs 10
grep '^gpu_warmup' "$logs/gpu_warmup.log" 2>/dev/null
# A test still running after 60 s dumps every thread's stack into the log (a hang shows where);
# with pytest-timeout (the GPU image has it) one past 90 s fails alone, so the session still
# ends with every failure's traceback (-rfE).
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=90 --timeout_method=signal")
step gpu_tests 240 python3 -m pytest -v -rfE --tb=short -m cuda -p no:cacheprovider \
  --durations=8 -o faulthandler_timeout=60 $per_test ${GPU_CHECK_TESTS:-tests/test_cuda_flashinfer.py \
  tests/test_cuda_flashinfer_mla.py tests/test_cuda.py}
grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E  " "$logs/gpu_tests.log" | tail -40
step gpu_bench 240 python3 benchmarks/gpu_bench.py --json "$logs/gpu_bench.json" &&
  sed -n '/^model:/p; /^| system/,$p' "$logs/gpu_bench.log"
# A hybrid (Gated DeltaNet + attention): greedy agreement with HF and tok/s, greedy/n=8/beams.
step hybrid 100 python3 benchmarks/hybrid.py --device cuda --num-prompts 64 --output-len 32 \
  --json "$logs/hybrid.json" &&
  sed -n '/^model:/p; /^greedy agreement/p; /^| workload/,$p' "$logs/hybrid.log"
step host_overhead 80 python3 benchmarks/host_overhead.py --device cuda --long-tokens 0 \
  --json "$logs/host_overhead.json" && sed -n '/^| system/,$p' "$logs/host_overhead.log"
# Beams, 64 prompts x W=4: host ms per step early and late (the real forward, stubbed, stubbed
# reading the K/V's bytes), function calls per step, HF's own host ms.
step host_beams 120 python3 benchmarks/host_overhead.py --device cuda --beams --repeats 2 \
  --json "$logs/host_beams.json" && sed -n '/^| system/,$p' "$logs/host_beams.log"
step overlap 100 python3 benchmarks/host_overhead.py --device cuda --overlap --overlap-model \
  --rows 64,256 --repeats 2 --json "$logs/overlap.json" &&
  sed -n '/^| model forward/,$p' "$logs/overlap.log"
# Tensor parallelism needs a GPU per rank: a 600M-parameter Llama in bf16, TP=1 vs TP=2.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -ge 2 ]; then
  step tensor_parallel 120 python3 benchmarks/tensor_parallel.py --device cuda --tp 1,2 \
    --repeats 2 --hidden-size 2048 --num-layers 8 --num-heads 32 --num-kv-heads 8 \
    --intermediate-size 8192 --vocab-size 32000 --dtype bfloat16 --num-prompts 128 \
    --min-prompt-len 64 --max-prompt-len 256 --output-len 64 \
    --json "$logs/tensor_parallel.json" && sed -n '/^model:/p; /^| TP/,$p' "$logs/tensor_parallel.log"
else
  echo "gpu_check: tensor parallel skipped (fewer than 2 GPUs: ${gpus:-0} listed by nvidia-smi -L)"
fi
# Quantized checkpoints (issue 41): compressed-tensors FP8 and INT4 equal HF on the GPU, online
# fp8 on sm89+, FlashInfer's fp8 pool with the checkpoint's k/v scales; tiny models, ~1 minute;
# last, so it never displaces the steps above (GPU_CHECK_STEPS=gpu_quant runs it alone).
step gpu_quant 90 python3 -m pytest -v -rfE --tb=short -m cuda -p no:cacheprovider $per_test \
  tests/test_cuda_quantization.py
# Vision-language models (issue 40): tiny llava, llava_next, idefics3, qwen2_5_vl, qwen3_vl and
# gemma3 give HF generate's greedy tokens on CUDA (float32, torch backend), and Gemma 3's
# bidirectional images through FlashInfer's custom mask follow the torch backend; tiny towers,
# about a minute; GPU_CHECK_STEPS="gpu_warmup gpu_vlm" runs it (after the kernels it loads).
step gpu_vlm 120 python3 -m pytest -v -rfE --tb=short -m cuda -p no:cacheprovider $per_test \
  --durations=8 tests/test_cuda_vlm.py
grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E  " "$logs/gpu_vlm.log" 2>/dev/null | tail -12
pack
echo "gpu_check: $((SECONDS - start)) s in all"
[ "$status" -eq 0 ] && echo "gpu_check: all steps passed" || echo "gpu_check: a step FAILED (logs: ${OUT:-$logs})"
exit "$status"

#!/usr/bin/env bash
# Downloads into .whl/ (kept out of git) the pinned transformers and the packages it needs that
# a GPU host's image may lack or hold older, as wheels for Python 3.12 on x86-64, so that
# scripts/gpu_check.sh runs the versions CI tests with (carry ".whl" beside the FlashInfer bundle).
# Versions come from scripts/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs="transformers huggingface-hub httpx2 httpcore2 truststore hf-xet kernels tomlkit click idna anyio h11
  compressed-tensors loguru"  # the last two: tests/test_cuda_quantization.py
rm -rf .whl && mkdir -p .whl
for p in $pkgs; do
  pin=$(grep -i -E "^${p//-/[-_]}==" scripts/constraints.txt || true)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${pin:-$p}"
done
ls .whl
du -sh .whl

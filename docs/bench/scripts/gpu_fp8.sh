#!/usr/bin/env bash
# One H200: issue 24's GPU tests (every FP8 kernel against its torch reference; FlashMLA's sparse
# FP8 decode tests beside them), then app.bench.fp8 (W8A8 GEMM TFLOP/s per backend at V3.2
# shapes, FP8 vs bf16 accuracy on a V3.2-shaped random model). Carry .whl (sgl-flash-mla);
# Ray is not needed. Logs and JSON under $OUT.
set -uo pipefail
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout 170 python3 -m pytest -q -m gpu tests/gpu/test_fp8_kernels.py \
    tests/gpu/test_flash_mla_sparse.py -k "fp8" -p no:cacheprovider -rf \
    2>&1 | tail -40 | tee "$OUT/gpu_fp8_tests.log"
timeout 150 python3 -m app.bench.fp8 --out "$OUT/fp8.json" 2>&1 | tail -30 \
    | tee "$OUT/fp8_bench.log"

#!/usr/bin/env bash
# One H200: the GPU tests (sparse kernels, indexer, DSA stage, decode graphs and engine after
# the PP=1 advance change), the sparse kernel timings, then the V3.2-shaped model's PP=1 TTFT at
# 64K and 128K. Carry .gpu (Ray) and .whl (sgl-flash-mla). Logs and JSON under $OUT.
set -uo pipefail
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/gpu/test_flash_mla_sparse.py tests/gpu/test_indexer_kernel.py \
    tests/gpu/test_dsa_cuda.py tests/gpu/test_decode_graphs.py tests/gpu/test_engine_cuda.py \
    -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests_v32.log"
timeout 120 python3 -m app.bench.sparse_mla --out "$OUT/sparse_mla.json" 2>&1 | tail -14
timeout 300 python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
    --linear torch --runs 65536:4096,131072:8192 --modes auto --reps 1 \
    --out "$OUT/deepseek_v32_pp1.json" 2>&1 | grep -v "^(raylet)" | tail -12

#!/usr/bin/env bash
# One H200, after the issue 21-27 merges: the GPU tests of the merged kernels (batched V3.2
# indexer, cuDNN MLA chunk attention at v 128, DSA stage, the grouped MoE incl. V4's swiglu
# clamp, the copy channel), then Qwen3-30B-A3B-shaped PP=1 TTFT at 32K/128K and
# DeepSeek-V2-Lite-shaped PP=1 TTFT at 32K. Carry .gpu (Ray) and .wt/lead (the sgl-flash-mla
# and llguidance wheels). GPU_TESTS=0 runs the benches alone.
set -uo pipefail
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wt/lead/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ "${GPU_TESTS:-1}" = 0 ] || timeout 170 python3 -m pytest -q -m gpu tests/gpu/test_indexer_kernel.py \
    tests/gpu/test_cudnn_attention.py tests/gpu/test_dsa_cuda.py tests/gpu/test_mla_moe_kernels.py \
    tests/gpu/test_copy_channel.py -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/gpu_tests_session3.log"
timeout 190 python3 -m app.bench.engine --model-shape qwen3-30b-a3b --pp 1 \
    --linear triton-persistent --runs 32768:4096,131072:8192 --modes auto --reps 1 \
    --out "$OUT/qwen3_30b_a3b_pp1.json" 2>&1 | grep -v "^(raylet)" | tail -12
timeout 100 python3 -m app.bench.engine --model-shape deepseek-v2-lite --pp 1 \
    --linear triton-persistent --runs 32768:4096 --modes auto --reps 1 \
    --out "$OUT/deepseek_v2_lite_pp1_32k_session3.json" 2>&1 | grep -v "^(raylet)" | tail -8

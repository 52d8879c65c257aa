#!/usr/bin/env bash
# Session 16, call 2 (one H200; carry .gpu .whl .tfw .commit): after call 1 (session 15's kernels
# on the host, docs/bench/session16/call1): the hyper-connections' finish a token a program, the
# top-k's new defaults and the W8A8 GEMM's skinny tiles against their references; the V4 decode
# stage in graphs again (FP8; W8A8 linears on cuBLASLt, and on the persistent Triton GEMM with
# its skinny tiles at 1 and 16 rows); V4's decode graph tests (graphed == eager == general;
# engine tokens == --enforce-eager's); then through the engine: FP8 decode at 512 rows and FP8
# TTFT at 64K-256K (suite rows).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=110 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_group_pool_cuda.py tests/gpu/test_triton_hyper.py tests/gpu/test_indexer_kernel.py \
  tests/gpu/test_fp8_kernels.py
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
LIMIT=40 step v4_decode_fp8_triton python3 -m app.bench.v4_decode --rows 1,16 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --linear triton-persistent --out "$R/v4_decode_fp8_triton.json"
LIMIT=150 step graph_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_v4_decode_graphs.py
for row in decode-v4-flash-512-fp8 ttft-v4-flash-fp8; do
  left=$((575 - SECONDS)); LIMIT=$((left < 120 ? left : 120)) step "$row" python3 -m app.cli bench suite --only "$row" --device cuda --timeout 115 --out "$R/suite"
done
tar czf "$OUT/results.tgz" -C "$OUT" r

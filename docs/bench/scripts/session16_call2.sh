#!/usr/bin/env bash
# Session 16, call 2 (one H200; carry .gpu .whl .tfw .commit): after call 1 (session 15's kernels
# on the host, docs/bench/session16/call1): the hyper-connections' finish a token a program and
# the top-k's new defaults and the W8A8 GEMM's skinny tiles against their references; the V4
# decode stage in graphs again (FP8; W8A8 linears on cuBLASLt and on the persistent Triton GEMM
# with its skinny tiles, one row to 64) and V4's decode linears alone; then V4's decode
# graphs (graphed == eager == general; engine tokens == --enforce-eager's) and the
# batched-against-alone engine test.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=110 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_group_pool_cuda.py tests/gpu/test_triton_hyper.py tests/gpu/test_indexer_kernel.py \
  tests/gpu/test_fp8_kernels.py
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
LIMIT=40 step v4_decode_fp8_triton python3 -m app.bench.v4_decode --rows 1,16,64 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --linear triton-persistent --out "$R/v4_decode_fp8_triton.json"
LIMIT=50 step decode_linears python3 -m app.bench.fp8 --decode-linears --out "$R/decode_linears.json"
LIMIT=150 step graph_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_v4_decode_graphs.py
LIMIT=$((575 - SECONDS)) step batched python3 -m pytest -rA -s -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 18 on one H100 (no H200 came; carry .gpu .whl .tfw .commit): correctness of session
# 17's kernels on SM90 -- their GPU tests, V4's and V3.2's decode graph tests, batched and
# staggered V4 requests against each alone -- then A/Bs on the same card only (H100 figures,
# not the issues' H200 ones): the GEMV against cuBLASLt per V4 linear, the V4 decode stage with
# the shared expert in the stack and beside it.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpu.txt"
LIMIT=100 step kernel_tests $GPU_PYTEST "${KERNEL_TESTS[@]}"
LIMIT=130 step graph_tests $GPU_PYTEST "${GRAPH_TESTS[@]}"
LIMIT=40 step decode_linears python3 -m app.bench.fp8 --decode-linears --out "$R/decode_linears.json"
V4="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8"
LIMIT=60 step v4_decode_fp8 $V4 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
LIMIT=50 step v4_decode_fp8_beside $V4 --rows 1,64,512 --shared-expert beside --out "$R/v4_decode_fp8_beside.json"
left=$((575 - SECONDS)); LIMIT=$((left < 200 ? left : 200)) step batched_v4 \
  $GPU_PYTEST -k v4 tests/gpu/test_batched_vs_alone_cuda.py
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 20, call 1 (one H200; carry .gpu .whl .tfw .commit): what session 19's H100 left for
# the H200 after the W8A8 GEMV went off by default -- the GPU tests the H100 did not reach
# (V4's FP8 stage against bf16, V3.2's decode graphs), the V4 decode stage in graphs (FP8,
# 1/64/512 rows: issue 34's one-row figure on the H200), the FP8 TTFT row (64K-256K, with the
# top-k's startup warm-up) and the FP8 engine decode at 512 rows; the 256K breakdown if time is
# left. Session 17's kernels' other tests passed on the H100 (docs/bench/session19/README.md).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
LEFT_TESTS=(tests/gpu/test_fp8_kernels.py::test_v4_stage_fp8_against_bf16
  tests/gpu/test_deepseek_decode_graphs.py)
LIMIT=150 step gpu_tests $GPU_PYTEST "${LEFT_TESTS[@]}"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
LIMIT=130 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 125 --out "$R/suite"
LIMIT=100 step decode-v4-flash-512-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-512-fp8 --device cuda --timeout 95 --out "$R/suite"
left=$((570 - SECONDS)); LIMIT=$((left < 60 ? left : 60)) step breakdown_fp8 \
  python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 --kv-cache-dtype fp8 \
  --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

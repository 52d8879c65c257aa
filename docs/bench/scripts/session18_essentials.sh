#!/usr/bin/env bash
# Session 18, one call in place of calls 1-2 when the device time left holds only one (one H200;
# carry .gpu .whl .tfw .commit): session 17's kernels' GPU tests, V4's and V3.2's decode graph
# tests, the V4 decode stage in graphs (FP8, 1/64/512 rows), the FP8 TTFT row with the startup
# warm-up and the FP8 engine decode at 512 rows (BUDGET: the seconds the call may take, 575).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
LIMIT=100 step kernel_tests $GPU_PYTEST "${KERNEL_TESTS[@]}"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
LIMIT=130 step graph_tests $GPU_PYTEST "${GRAPH_TESTS[@]}"
left=$((${BUDGET:-575} - SECONDS)); LIMIT=$((left < 150 ? left : 150)) step ttft-v4-flash-fp8 \
  python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda \
  --timeout $((LIMIT - 5)) --out "$R/suite"
left=$((${BUDGET:-575} - SECONDS)); LIMIT=$((left < 100 ? left : 100)) step decode-v4-flash-512-fp8 \
  python3 -m app.cli bench suite --only decode-v4-flash-512-fp8 --device cuda \
  --timeout $((left - 5)) --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

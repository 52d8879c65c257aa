#!/usr/bin/env bash
# Session 18, call 2 (one H200, after session18_call1.sh; carry .gpu .whl .tfw .commit): session
# 17's calls 2 and 3 in one: V4's and V3.2's decode graph tests (graphed == eager == the general
# path; the engine's graphed tokens == --enforce-eager's), the FP8 TTFT row with the startup
# warm-up and the FP8 engine decode at 512 rows, then batched and staggered V4 requests against
# the same request alone on the CUDA kernels.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
LIMIT=130 step graph_tests $GPU_PYTEST "${GRAPH_TESTS[@]}"
LIMIT=150 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 145 --out "$R/suite"
LIMIT=100 step decode-v4-flash-512-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-512-fp8 --device cuda --timeout 95 --out "$R/suite"
left=$((570 - SECONDS)); LIMIT=$((left < 200 ? left : 200)) step batched_v4 \
  $GPU_PYTEST -k v4 tests/gpu/test_batched_vs_alone_cuda.py
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 23, call 3 (one H100 or H200; carry .gpu .whl .tfw .commit), after the MoE's prefill
# launch moved to 64-row tiles, 3 stages, 3 programs an SM (call 2's sweep): the FP8 MoE's GPU
# tests at the new launch, the old and new launches at both bench shapes (V4-Flash 8K, V3.2-bench
# 4K), and the last 8K chunk of 256K by groups again (call 2: the MoE 29.4 ms).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
F=tests/gpu/test_fp8_kernels.py
LIMIT=90 step gpu_tests $GPU_PYTEST $F::test_fp8_experts_match_reference \
  $F::test_grouped_gemm_through_tma_equals_the_pointer_loads
LIMIT=60 step moe_loop_shapes python3 -m app.bench.fp8 --moe-loops --moe-loop-shapes \
  --out "$R/moe_loop_shapes.json"
left=$((${DEADLINE:-300} - SECONDS)); LIMIT=$((left < 80 ? left : 80))
[ $left -gt 30 ] && step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 \
  --out "$R/breakdown_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

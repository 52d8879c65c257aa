#!/usr/bin/env bash
# Session 24, call 1 (one H100 or H200; carry .gpu .whl .tfw .commit): does session 23's MoE
# launch (three 64-row programs an SM) reach the V4-Flash FP8 TTFT row; the same prompts at 16K
# chunks (gate/up's FLOP a weight byte double: 768 against the H100's ridge of 591); then
# session23_call3's steps (the MoE's GPU tests at the new launch, old against new launch at both
# bench shapes, the last 8K chunk of 256K by groups).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
LIMIT=150 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 145 --out "$R/suite"
LIMIT=150 step ttft_16k python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 \
  --linear auto --runs 131072:16384,262144:16384 --modes auto --reps 1 --quantization fp8 \
  --kv-cache-dtype fp8 --out "$R/ttft_16k.json"
F=tests/gpu/test_fp8_kernels.py
LIMIT=90 step gpu_tests $GPU_PYTEST $F::test_fp8_experts_match_reference \
  $F::test_grouped_gemm_through_tma_equals_the_pointer_loads
LIMIT=60 step moe_loop_shapes python3 -m app.bench.fp8 --moe-loops --moe-loop-shapes \
  --out "$R/moe_loop_shapes.json"
left=$((${DEADLINE:-560} - SECONDS)); LIMIT=$((left < 80 ? left : 80))
[ $left -gt 30 ] && step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 \
  --out "$R/breakdown_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

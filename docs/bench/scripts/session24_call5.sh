#!/usr/bin/env bash
# Session 24, call 5 (one H100 or H200; carry .gpu .whl/sgl_flash_mla-*.whl .tfw .commit: the
# engine no longer imports llguidance): the final tree (the MoE's prefill launch back to one
# 128-row program an SM, the indexer's chunk kernel at 168 registers over FP8 keys) — the
# kernels' GPU tests, the V4-Flash FP8 TTFT row, then V4 FP8 batched against alone if the
# deadline (DEADLINE, default 400 s) leaves it time.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
F=tests/gpu/test_fp8_kernels.py
LIMIT=80 step gpu_tests $GPU_PYTEST tests/gpu/test_indexer_kernel.py \
  $F::test_fp8_experts_match_reference $F::test_grouped_gemm_through_tma_equals_the_pointer_loads
left=$((${DEADLINE:-400} - SECONDS)); LIMIT=$((left < 230 ? left : 230))
[ $left -gt 120 ] && step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout $((LIMIT - 5)) --out "$R/suite"
left=$((${DEADLINE:-400} - SECONDS)); LIMIT=$((left < 120 ? left : 120))
T=tests/gpu/test_batched_vs_alone_cuda.py::test_batched_and_staggered_against_alone_and_eager
[ $left -gt 60 ] && step batched_v4-fp8 $GPU_PYTEST --tb=short "$T[v4-fp8]"
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 31, call 2 (call 1's warm machine: DeepGEMM built in /tmp/dg, FlashMLA and transformers
# in /tmp/site; carry .gpu, .commit): V4-Flash's FP8 TTFT rows (64K-256K) with deep_gemm on the
# path (moe_experts_fp8's deepgemm backend, auto's first) and without it (triton-persistent), in
# turn; then the 512K and 1M rows with it if time is left.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-575}
LIMIT=150 step ttft_fp8_deepgemm /tmp/with_dg python3 -m app.cli bench suite --only \
  ttft-v4-flash-fp8 --device cuda --timeout 140 --out "$R/suite_deepgemm"
LIMIT=150 step ttft_fp8_triton python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 140 --out "$R/suite_triton"
left=$((D - SECONDS))
[ $left -gt 160 ] && LIMIT=$((left - 10)) step ttft_1m_fp8_deepgemm /tmp/with_dg python3 -m \
  app.cli bench suite --only ttft-v4-flash-1m-fp8 --device cuda --timeout $((left - 20)) \
  --out "$R/suite_1m_deepgemm"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

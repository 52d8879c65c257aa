#!/usr/bin/env bash
# Session 23, call 2 (one H100 or H200; carry .gpu .whl .tfw .commit): the grouped FP8 MoE
# GEMMs' launches beyond the tile sweep (two 64-row programs an SM, Triton's flattened and
# warp-specialized persistent loops, the lagged promotion) and the unfused SwiGLU quantizer's
# launches, both with their bits against the default's; then the last 8K chunk of 256K by groups.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=200 step moe_loops python3 -m app.bench.fp8 --moe-loops --out "$R/moe_loops.json"
LIMIT=100 step swiglu_quantizer python3 -m app.bench.fp8 --swiglu-quantizer \
  --out "$R/swiglu_quantizer.json"
left=$((${DEADLINE:-560} - SECONDS)); LIMIT=$((left < 120 ? left : 120))
[ $left -gt 30 ] && step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 \
  --out "$R/breakdown_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

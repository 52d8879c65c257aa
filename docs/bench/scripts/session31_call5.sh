#!/usr/bin/env bash
# Session 31, call 5 (call 4's warm H200: DeepGEMM in /tmp/dg, FlashMLA and transformers in
# /tmp/site; carry .gpu, .commit): V4-Flash's FP8 TTFT rows of record with DeepGEMM's grouped
# GEMMs in the MoE (64K-256K, then 512K and 1,040,384 tokens), then the bf16 rows (64K-256K:
# issue 35's "FP8 at least 25 % faster than bf16 at 256K") if time is left.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-575}
LIMIT=150 step ttft_fp8_deepgemm /tmp/with_dg python3 -m app.cli bench suite --only \
  ttft-v4-flash-fp8 --device cuda --timeout 140 --out "$R/suite_fp8"
LIMIT=220 step ttft_1m_fp8_deepgemm /tmp/with_dg python3 -m app.cli bench suite --only \
  ttft-v4-flash-1m-fp8 --device cuda --timeout 210 --out "$R/suite_1m_fp8"
left=$((D - SECONDS))
[ $left -gt 80 ] && LIMIT=$((left - 10)) step ttft_bf16 python3 -m app.cli bench suite --only \
  ttft-v4-flash --device cuda --timeout $((left - 20)) --out "$R/suite_bf16"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

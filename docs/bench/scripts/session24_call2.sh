#!/usr/bin/env bash
# Session 24, call 2 (the same warm machine; carry .gpu .whl .tfw .commit, .whl now with
# llguidance, which the engine imports and call 1 lacked): call 1's two TTFT steps, then the
# V4-Flash FP8 decode rows (1-512 rows through the engine) as time allows.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=150 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 145 --out "$R/suite"
LIMIT=150 step ttft_16k python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 \
  --linear auto --runs 131072:16384,262144:16384 --modes auto --reps 1 --quantization fp8 \
  --kv-cache-dtype fp8 --out "$R/ttft_16k.json"
left=$((${DEADLINE:-500} - SECONDS)); LIMIT=$((left < 130 ? left : 130))
[ $left -gt 60 ] && step v4_decode python3 -m app.bench.v4_decode --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

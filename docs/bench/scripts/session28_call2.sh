#!/usr/bin/env bash
# Session 28, call 2 (one GPU, the machine of call 1; carry as call 1): the tree's V4-Flash FP8
# rows of record: ttft-v4-flash-fp8 (64K / 128K / 256K), the 256K last chunk by groups, and the
# one-row / 512-row FP8 decode step in graphs. On an H200 with needs_h200, ONE_M=1 runs the
# 1,040,384-token row first.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${ONE_M:-0}" = 1 ]; then
  LIMIT=440 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 \
    --device cuda --timeout 435 --out "$R/suite"
fi
LIMIT=240 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 235 --out "$R/suite"
left=$((${DEADLINE:-580} - SECONDS))
[ $left -gt 80 ] && LIMIT=80 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown \
  --linear auto --quantization fp8 --kv-cache-dtype fp8 \
  --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
left=$((${DEADLINE:-580} - SECONDS))
[ $left -gt 60 ] && LIMIT=$((left - 5)) step v4_decode python3 -m app.bench.v4_decode \
  --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,512 --out "$R/v4_decode.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

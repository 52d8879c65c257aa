#!/usr/bin/env bash
# Session 18, call 3 (one H200, after call 2; carry .gpu .whl .tfw .commit): the last 8K chunk of
# 256K by kernel group (FP8 weights + FP8 KV) after session 17's MoE epilogue and rule top-k, the
# engine's one-row FP8 decode (issue 34's latency row), then the 1M-token FP8 TTFT (issue 35).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=60 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
LIMIT=100 step decode-v4-flash-itl-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-itl-fp8 --device cuda --timeout 95 --out "$R/suite"
left=$((570 - SECONDS)); LIMIT=$((left < 300 ? left : 300)) step ttft-v4-flash-1m-fp8 \
  python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 --device cuda --timeout $((left - 5)) \
  --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 21, call 3 (one H200; carry .gpu .whl .tfw .commit): the 512K and 1,040,384-token FP8
# TTFT row (issue 35's 1M target), then, as time allows, the bf16 rows issue 34 and 35 read the
# FP8 ones against (V4-Flash decode at 512 rows and 1-256 rows, TTFT 64K-256K) and the decode
# rows issue 34 says must not slow down (V3.2-bench at 512 rows, Llama-8B at 64).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=330 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 \
  --device cuda --timeout 325 --out "$R/suite"
for row in decode-v4-flash-512 ttft-v4-flash decode-v4-flash-itl decode-v32-512 \
  decode-llama8b-64; do
  left=$((575 - SECONDS)); [ $left -lt 40 ] && break
  LIMIT=$((left < 130 ? left : 130))
  step $row python3 -m app.cli bench suite --only $row --device cuda --timeout $((LIMIT - 5)) \
    --out "$R/suite"
done
tar czf "$OUT/results.tgz" -C "$OUT" r

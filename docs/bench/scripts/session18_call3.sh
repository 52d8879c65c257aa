#!/usr/bin/env bash
# Session 18, call 3 (one H200, after call 2; carry .gpu .whl .tfw .commit): the engine's one-row
# FP8 decode (issue 34's latency row), then the 1M-token FP8 TTFT (issue 35).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=100 step decode-v4-flash-itl-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-itl-fp8 --device cuda --timeout 95 --out "$R/suite"
left=$((570 - SECONDS)); LIMIT=$((left < 300 ? left : 300)) step ttft-v4-flash-1m-fp8 \
  python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 --device cuda --timeout $((left - 5)) \
  --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

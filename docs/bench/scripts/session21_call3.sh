#!/usr/bin/env bash
# Session 21, call 3 (one H200; carry .gpu .whl .tfw .commit): the 512K and 1,040,384-token FP8
# TTFT row (issue 35's 1M target).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=560 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 \
  --device cuda --timeout 555 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

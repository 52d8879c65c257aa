#!/usr/bin/env bash
# Session 16, call 3 (one H200; carry .gpu .whl .tfw .commit): the suite rows of issues 34 and 35
# through the engine: TTFT of V4-Flash in FP8 (64K-256K, then 512K and 1,040,384 tokens) and
# decode in FP8 at 512 rows and at 1-256 rows (ITL), and bf16 at 512 rows.
set -u
. docs/bench/scripts/host_env.sh
for row in ttft-v4-flash-fp8 ttft-v4-flash-1m-fp8 decode-v4-flash-512-fp8 decode-v4-flash-itl-fp8 decode-v4-flash-512; do
  LIMIT=130 step "$row" python3 -m app.cli bench suite --only "$row" --device cuda --timeout 125 --out "$R/suite"
done
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 17, call 3 (one H200, after calls 1-2; carry .gpu .whl .tfw .commit): through the
# engine, the FP8 TTFT row with the startup warm-up (session 16's call 3, never run) and the FP8
# decode at 512 rows; then the rest of the FP8 kernel tests.
set -u
. docs/bench/scripts/host_env.sh
for row in ttft-v4-flash-fp8 decode-v4-flash-512-fp8; do
  left=$((575 - SECONDS)); LIMIT=$((left < 160 ? left : 160)) step "$row" python3 -m app.cli bench \
    suite --only "$row" --device cuda --timeout 155 --out "$R/suite"
done
left=$((575 - SECONDS)); LIMIT=$((left < 200 ? left : 200)) step fp8_kernel_tests \
  python3 -m pytest -rA -q -m gpu -p no:cacheprovider tests/gpu/test_fp8_kernels.py
tar czf "$OUT/results.tgz" -C "$OUT" r

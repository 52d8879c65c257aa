#!/usr/bin/env bash
# Session 16, call 3 (one H200; carry .gpu .whl .tfw .commit): the batched-against-alone engine
# test on the CUDA kernels, then the suite rows left: FP8 decode at 1-256 rows (ITL) and FP8
# TTFT at 512K and 1,040,384 tokens.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=300 step batched python3 -m pytest -rA -s -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py
for row in decode-v4-flash-itl-fp8 ttft-v4-flash-1m-fp8; do
  left=$((575 - SECONDS)); LIMIT=$((left < 130 ? left : 130)) step "$row" python3 -m app.cli bench suite --only "$row" --device cuda --timeout 125 --out "$R/suite"
done
tar czf "$OUT/results.tgz" -C "$OUT" r

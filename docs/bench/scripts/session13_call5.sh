#!/usr/bin/env bash
# Session 13, call 5 (one H200, Ray carried): the batched-vs-alone engine test's V4 FP8 case
# under its new bound (1d259d7). Results under $OUT/r.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=200 step batched_v4_fp8 python3 -m pytest -rA -s -m gpu -p no:cacheprovider -k "v4-fp8" \
  tests/gpu/test_batched_vs_alone_cuda.py

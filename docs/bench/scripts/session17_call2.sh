#!/usr/bin/env bash
# Session 17, call 2 (one H200, after call 1; carry .gpu .whl .tfw .commit): batched and
# staggered requests against the same request alone on the CUDA kernels (V4 cases first: the
# hc split and the MoE layout depend on the batch), the rest of the FP8 kernel tests, and the
# engine's FP8 decode at 512 rows.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=300 step batched_v4 python3 -m pytest -rA -q -m gpu -p no:cacheprovider -k v4 \
  tests/gpu/test_batched_vs_alone_cuda.py
LIMIT=120 step fp8_kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_fp8_kernels.py
left=$((575 - SECONDS)); LIMIT=$((left < 130 ? left : 130)) step decode-v4-flash-512-fp8 \
  python3 -m app.cli bench suite --only decode-v4-flash-512-fp8 --device cuda --timeout 125 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

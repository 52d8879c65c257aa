#!/usr/bin/env bash
# Session 13, call 5 (one H200, Ray carried): the batched-vs-alone engine test's V4 FP8 case
# under its new bound (1d259d7). Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
timeout 200 python3 -m pytest -rA -s -m gpu -p no:cacheprovider -k "v4-fp8" \
  tests/gpu/test_batched_vs_alone_cuda.py > "$R/batched_v4_fp8.log" 2>&1; echo "rc $?" | tee -a "$R/batched_v4_fp8.log"
tail -5 "$R/batched_v4_fp8.log"

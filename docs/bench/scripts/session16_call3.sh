#!/usr/bin/env bash
# Session 16, call 3 (one H200; carry .gpu .whl .tfw .commit): FP8 TTFT of V4-Flash again with
# the indexer top-k's launches compiled at startup (call 2's 64K and 128K runs paid for the
# compiles: 1.565 / 3.427 s), then the batched-against-alone engine test on the CUDA kernels, V4 (the time left holds its three formats)
# in what is left of the call (-v: each test's result as it ends).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=100 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 95 --out "$R/suite"
LIMIT=$((225 - SECONDS)) step batched python3 -m pytest -rA -v -s -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py -k v4
tar czf "$OUT/results.tgz" -C "$OUT" r

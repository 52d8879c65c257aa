#!/usr/bin/env bash
# Session 15, call 2 (one H200, after call 1 passes): V4's decode graphs (graphed == eager ==
# the general path; the engine's graphed tokens == --enforce-eager's) and the batched-vs-alone
# engine test on the new kernels.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=200 step graph_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_v4_decode_graphs.py
LIMIT=300 step batched python3 -m pytest -rA -s -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 17, call 2 (one H200, after call 1; carry .gpu .whl .tfw .commit): correctness through
# the engine on the CUDA kernels: V4's decode graph tests (graphed == eager == the general path;
# the engine's graphed tokens == --enforce-eager's), then batched and staggered requests against
# the same request alone (V4 cases: the hc split and the MoE layout depend on the batch).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=150 step graph_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_v4_decode_graphs.py tests/gpu/test_deepseek_decode_graphs.py
left=$((575 - SECONDS)); LIMIT=$((left < 400 ? left : 400)) step batched_v4 \
  python3 -m pytest -rA -q -m gpu -p no:cacheprovider -k v4 tests/gpu/test_batched_vs_alone_cuda.py
tar czf "$OUT/results.tgz" -C "$OUT" r

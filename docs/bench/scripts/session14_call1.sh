#!/usr/bin/env bash
# Session 14, call 1 (one H200, Ray carried), at 7a5204e: what session 13 left unrun there:
# rope_tail / rms_norm_fp32 GPU tests after the review commit, and the V4 decode graphs' FP8
# engine case (graphed tokens == --enforce-eager's), cut by the step limit in session 13 call 7.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=60 step rope_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider tests/gpu/test_triton_rope.py
LIMIT=200 step v4_engine_graphs python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_v4_decode_graphs.py -k engine
tar czf "$OUT/results.tgz" -C "$OUT" r

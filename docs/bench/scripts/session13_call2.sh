#!/usr/bin/env bash
# Session 13, call 2 (one H200, Ray carried): the rope_tail GPU test after its tolerance mend,
# the tile sweeps of rope_tail and the hyper-connections' _project, and V4-Flash FP8 TTFT at
# 64K / 128K / 256K through the engine with rope_tail on Triton. Results under $OUT/r.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=100 step rope_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider tests/gpu/test_triton_rope.py
LIMIT=150 step sweep python3 docs/bench/scripts/session13_sweep.py "$R/sweep.jsonl"
LIMIT=230 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 220 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

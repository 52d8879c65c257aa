#!/usr/bin/env bash
# Session 13, call 4 (one H200, Ray carried): the batched-vs-alone engine test on V4 / V3.2 after
# rope_tail, the swept _project tiles and session 12's V4 FP8 chunk / decode split (b15ff42),
# then the V4-Flash FP8 512K / 1M TTFT row. Results under $OUT/r.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=400 step batched python3 -m pytest -rA -s -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py
LIMIT=180 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 --device cuda --timeout 175 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

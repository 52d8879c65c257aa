#!/usr/bin/env bash
# Session 21, call 2 (one H200; carry .gpu .whl .tfw .commit): staggered and batched requests
# against each alone through the graphed engine, one pytest a case so a case cut by its limit
# still leaves the others' reports (session 20's whole-file run lost v32-fp8's failure report to
# the call's limit; alone it passed three times), then the engine's ITL rows (1-256 rows, FP8).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
T=tests/gpu/test_batched_vs_alone_cuda.py
for id in $(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider $T | grep ::); do
  name=${id##*[}; LIMIT=80 step "batched_${name%]}" $GPU_PYTEST --tb=short "$id"
done
left=$((575 - SECONDS)); LIMIT=$((left < 100 ? left : 100))
step decode-v4-flash-itl-fp8 python3 -m app.cli bench suite --only decode-v4-flash-itl-fp8 \
  --device cuda --timeout $((LIMIT - 5)) --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 22, call 3 (one H100 or H200; carry .gpu .whl .tfw .commit): each staggered-and-batched
# case against its requests alone through the graphed engine, one pytest a case, then the
# 512-row FP8 decode row again with where its lockstep window comes from (call 2's closed to
# under a step: 78,939 "tok/s", ITL none; raw's decode.runs[].stream now gives the requests'
# first and last tokens), all within DEADLINE seconds (default 585).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
T=tests/gpu/test_batched_vs_alone_cuda.py
for id in $(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider $T | grep ::); do
  left=$((${DEADLINE:-585} - 100 - SECONDS)); [ $left -lt 40 ] && { echo "no time for $id"; continue; }
  name=${id##*[}; LIMIT=$((left < 80 ? left : 80)) step "batched_${name%]}" $GPU_PYTEST --tb=short "$id"
done
left=$((${DEADLINE:-585} - SECONDS)); LIMIT=$((left < 90 ? left : 90)) step decode-v4-flash-512-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-512-fp8 --device cuda --timeout $((LIMIT - 5)) --out "$R/suite"
python3 -c "import json; r = json.load(open('$R/suite/decode-v4-flash-512-fp8.json'))['raw']['decode']['runs'][0]; print({k: r[k] for k in ('wall_s', 'microbatches', 'stage_forward_s', 'steady_tokens_per_s', 'itl_p50_ms', 'stream')})" | tee "$R/decode_stream.txt"
tar czf "$OUT/results.tgz" -C "$OUT" r

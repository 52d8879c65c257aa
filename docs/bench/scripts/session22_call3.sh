#!/usr/bin/env bash
# Session 22, call 3 (one H100 or H200; carry .gpu .whl .tfw .commit), within DEADLINE seconds
# (default 585): V4 over W8A8 + FP8 KV staggered and batched against its requests alone through
# the graphed engine (the MoE's fused/unfused split, the top-k's kernel/torch split, the prefill
# tiles' TMA all in force), then the 512-row FP8 decode row again with where its lockstep window
# comes from (call 2's closed to under a step: 78,939 "tok/s", no ITL; raw's decode.runs[].stream
# now gives the requests' first and last tokens), then the other batched cases as time allows,
# one pytest a case.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
T=tests/gpu/test_batched_vs_alone_cuda.py::test_batched_and_staggered_against_alone_and_eager
batched() {  # one case (up to 120 s: V4 FP8 took over 78 on a fresh H100), if the deadline leaves it 40 s
  local left=$((${DEADLINE:-585} - ${1} - SECONDS)); [ $left -lt 40 ] && { echo "no time for $2"; return; }
  LIMIT=$((left < 120 ? left : 120)) step "batched_$2" $GPU_PYTEST --tb=short "$T[$2]"
}
batched 90 v4-fp8
left=$((${DEADLINE:-585} - SECONDS)); LIMIT=$((left < 90 ? left : 90))  # before the line that reads it
step decode-v4-flash-512-fp8 \
  python3 -m app.cli bench suite --only decode-v4-flash-512-fp8 --device cuda \
  --timeout $((LIMIT - 5)) --out "$R/suite"
python3 -c "import json; r = json.load(open('$R/suite/decode-v4-flash-512-fp8.json'))['raw']['decode']['runs'][0]; print({k: r[k] for k in ('wall_s', 'microbatches', 'stage_forward_s', 'steady_tokens_per_s', 'itl_p50_ms', 'stream')})" | tee "$R/decode_stream.txt"
for case in v4-w8a8 v32-fp8 v4-bf16 v32-w8a8 v32-bf16; do batched 0 $case; done
tar czf "$OUT/results.tgz" -C "$OUT" r

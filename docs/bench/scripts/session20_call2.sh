#!/usr/bin/env bash
# Session 20, call 2 (one H200; carry .gpu .whl .tfw .commit): staggered and batched requests
# against each alone through the graphed engine (V4 and V3.2, bf16 / W8A8 / FP8 KV: V4's
# W8A8 and FP8 cases passed on the H100 only with the GEMV off), session 17's A/Bs (the MoE's
# fused SwiGLU epilogue, the rule's top-k against torch's) and the one-row engine ITL row.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
LIMIT=240 step batched $GPU_PYTEST tests/gpu/test_batched_vs_alone_cuda.py
LIMIT=50 step moe_swiglu python3 -m app.bench.fp8 --moe-swiglu --out "$R/moe_swiglu.json"
LIMIT=60 step rule_topk python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x1:2304,512x1:2304,1x8192:262144 --out "$R/indexer_select.json"
left=$((570 - SECONDS)); LIMIT=$((left < 100 ? left : 100)) step decode-v4-flash-itl-fp8 \
  python3 -m app.cli bench suite --only decode-v4-flash-itl-fp8 --device cuda \
  --timeout $((LIMIT - 5)) --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

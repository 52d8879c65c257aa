#!/usr/bin/env bash
# Session 27, call 6 (one GPU, whichever comes, in the ~300 s of device time left; carry as call
# 4): on an H200 the ttft-v4-flash-fp8 rows of record at this tree (PDL, the scales a step
# ahead); on an H100 the fused gate/up MoE at 1-16 decode rows over (warps, stages)
# (app.bench.fp8 --moe-swiglu-launches), then the decode tile sweep of the grouped GEMMs.
set -u
. docs/bench/scripts/host_env.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  LIMIT=260 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
    --device cuda --timeout 255 --out "$R/suite"
  grep -h "^| " $R/*.log
else
  LIMIT=120 step swiglu_launches python3 -m app.bench.fp8 --moe-swiglu-launches \
    --out "$R/swiglu_launches.json"
  LIMIT=130 step decode_tiles python3 -m app.bench.fp8 --moe-decode-tiles --out "$R/decode_tiles.json"
fi
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 33, the last device time (one H200; carry .gpu, .whl, .commit): issue 34's decode
# steps on their chip at this tree, V4-Flash's 8-layer stage in graphs at context 512: bf16 (the
# bf16 stage does not fit an H100; last measured on an H200 in session 16) and FP8.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT=100 step v4_decode_bf16 python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 \
  --out "$R/v4_decode_bf16.json"
LIMIT=80 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,512 --out "$R/v4_decode_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

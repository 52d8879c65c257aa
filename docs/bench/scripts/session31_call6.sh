#!/usr/bin/env bash
# Session 31, call 6 (one H200, the session's last device time; carry .gpu, .whl, .commit,
# .gpu-deepgemm: .tfw left out for the 64 MiB, nothing here imports transformers): DeepGEMM
# built, then in order while time lasts: V4-Flash's FP8 TTFT rows with DeepGEMM's grouped GEMMs
# in the MoE (64K-256K, then 512K and 1,040,384 tokens), the bf16 decode steps in graphs (the
# 8-layer bf16 stage does not fit an H100), the bf16 TTFT rows (FP8 against bf16 at 256K), the
# FP8 decode steps with their small launches' sources (--stacks, added in session 32).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
use_deepgemm 110
run ttft_fp8_deepgemm 150 /tmp/with_dg python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 140 --out "$R/suite_fp8"
run ttft_1m_fp8_deepgemm 200 /tmp/with_dg python3 -m app.cli bench suite --only \
  ttft-v4-flash-1m-fp8 --device cuda --timeout 190 --out "$R/suite_1m_fp8"
run v4_decode_bf16 70 python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 \
  --out "$R/v4_decode_bf16.json"
run ttft_bf16 110 python3 -m app.cli bench suite --only ttft-v4-flash --device cuda \
  --timeout 100 --out "$R/suite_bf16"
run v4_decode_fp8 50 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,512 --stacks --out "$R/v4_decode_fp8.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

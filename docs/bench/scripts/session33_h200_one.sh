#!/usr/bin/env bash
# Session 33, the H200 rows of record in one call (carry .gpu, .whl, .commit, .gpu-deepgemm),
# most wanted first, each run only while time is left: DeepGEMM built; V4-Flash FP8 TTFT at
# 512K and 1,040,384 tokens with DeepGEMM's grouped GEMMs in the MoE (an H200-only row); the
# same at 64K-256K; the bf16 decode steps in graphs (the bf16 stage does not fit an H100); the
# FP8 decode steps with their small launches' sources (--stacks); session 34's decode linear's
# shapes against cuBLASLt (graph-timed). The suite keeps each row's
# JSON (for docs/bench/latest, its environment naming deep_gemm) and whole log.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
use_deepgemm 110
SUITE="python3 -m app.cli bench suite --device cuda --out $R/suite"
run ttft_1m_fp8_deepgemm 230 /tmp/with_dg $SUITE --only ttft-v4-flash-1m-fp8 --timeout 220
run ttft_fp8_deepgemm 160 /tmp/with_dg $SUITE --only ttft-v4-flash-fp8 --timeout 150
run v4_decode_bf16 75 python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 \
  --out "$R/v4_decode_bf16.json"
run v4_decode_fp8 60 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,512 --stacks --out "$R/v4_decode_fp8.json"
run decode_linear 40 python3 -m app.bench.fp8_decode_linear --rows 1,16 \
  --out "$R/decode_linear.json"
grep -ih "ttft\|error\|Traceback\|ms a step" $R/*.log | cut -c1-240 | head -40
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

#!/usr/bin/env bash
# Session 35, the H200 rows of record after session 34's decode kernels, in one call (carry .gpu,
# .whl, .commit, .gpu-deepgemm), most wanted first: the V4-Flash decode steps in graphs (FP8 and
# bf16, 1/16/512 rows), the decode linear's shapes against cuBLASLt, then DeepGEMM built and the
# FP8 TTFT rows at 64K-256K through the suite with DeepGEMM's grouped GEMMs in the MoE.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
run v4_decode_fp8 100 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,512 --out "$R/v4_decode_fp8.json"
run v4_decode_bf16 80 python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 \
  --out "$R/v4_decode_bf16.json"
run decode_linear 40 python3 -m app.bench.fp8_decode_linear --rows 1,16 \
  --out "$R/decode_linear.json"
use_deepgemm 110
SUITE="python3 -m app.cli bench suite --device cuda --out $R/suite"
run ttft_fp8_deepgemm 160 /tmp/with_dg $SUITE --only ttft-v4-flash-fp8 --timeout 150
grep -ih "ttft\|error\|Traceback\|ms a step" $R/*.log | cut -c1-240 | head -40
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

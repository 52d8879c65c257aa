#!/usr/bin/env bash
# Session 13, call 7 (one H200, Ray carried; the last of the device budget, so each step writes
# its log under $OUT/r as it ends): after V4's weighted norms went to Triton (rope_tail's
# weighted mode, rms_norm_fp32): their GPU tests, V4's decode graphs against eager, the V4 decode
# stage in FP8 and bf16, the 256K FP8 chunk's breakdown, the FP8 TTFT row.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=60 step rope_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider tests/gpu/test_triton_rope.py
LIMIT=110 step v4_graphs python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_deepseek_v4_decode_graphs.py
LIMIT=40 step v4_decode_fp8 python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
LIMIT=40 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
LIMIT=40 step v4_decode_none python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization none --kv-cache-dtype auto --out "$R/v4_decode_none.json"
LIMIT=80 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 75 --out "$R/suite"

#!/usr/bin/env bash
# Session 13, call 3 (one H200, Ray carried): after the swept tiles (rope_tail, the
# hyper-connections' _project): the GPU tests of both kernels and of V4 (graphs equal eager), the
# 256K chunk's breakdown in FP8 and bf16, the V4 decode stage in FP8 and bf16, and V4-Flash FP8
# TTFT at 64K-256K through the engine. Results under $OUT/r.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=200 step gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_triton_rope.py \
  tests/gpu/test_triton_hyper.py tests/gpu/test_deepseek_v4_decode_graphs.py
for q in fp8 none; do
  kv=$([ $q = fp8 ] && echo fp8 || echo auto)
  LIMIT=100 step breakdown_$q python3 -m app.bench.deepseek_breakdown --linear auto --quantization $q \
    --kv-cache-dtype $kv --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_$q.json"
  LIMIT=100 step v4_decode_$q python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
    --quantization $q --kv-cache-dtype $kv --out "$R/v4_decode_$q.json"
done
LIMIT=200 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 190 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

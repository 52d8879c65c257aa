#!/usr/bin/env bash
# Session 14, call 3 (one H200, Ray carried): after the query quantizer kernel, FP8 decode rows on
# FP8 tensor cores and the chunk launch per key dtype: the indexer sweep (chunk launches at
# 64-token tiles, decode launches, the quantizer), the indexer GPU tests, the V4 FP8 256K chunk's
# breakdown, the V4 decode stage in FP8, the FP8 TTFT rows (64K-256K, 512K and 1,040,384 tokens).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=150 step sweep python3 docs/bench/scripts/session14_indexer_sweep.py --out "$R/sweep.jsonl"
LIMIT=90 step indexer_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_dsa_cuda.py tests/gpu/test_deepseek_v4_cuda.py
LIMIT=50 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
LIMIT=50 step v4_decode_fp8 python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
LIMIT=120 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 115 --out "$R/suite"
LIMIT=150 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 --device cuda --timeout 145 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

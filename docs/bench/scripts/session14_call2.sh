#!/usr/bin/env bash
# Session 14, call 2 (one H200, Ray carried): the FP8 indexer keys in their block layout
# (values 16-byte aligned, the scales after each block's values), V4 storing them FP8 under an
# FP8 cache again: the chunk kernel's launch sweep and the decode rows over FP8 pages; the
# indexer kernels' GPU tests; the V4 FP8 256K chunk's breakdown and the V4 decode stage in FP8.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=240 step sweep python3 docs/bench/scripts/session14_indexer_sweep.py --out "$R/sweep.jsonl"
LIMIT=120 step indexer_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_dsa_cuda.py tests/gpu/test_deepseek_v4_cuda.py
LIMIT=50 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
LIMIT=50 step v4_decode_fp8 python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

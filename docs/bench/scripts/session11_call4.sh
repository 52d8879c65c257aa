#!/usr/bin/env bash
# Session 11, the shipped state on one H200 (Ray carried): V4's indexer keys back in bf16 under
# FP8 KV (V3.2 keeps FP8 keys and scores them in FP8). The 256K chunk's FP8 breakdown, the
# V4-Flash FP8 TTFT rows, and the GPU tests of the indexer, DSA and V4. Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; }
step breakdown_fp8 python -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
for row in ttft-v4-flash-fp8 ttft-v4-flash-1m-fp8; do
  LIMIT=200 step $row python -m app.cli bench suite --only $row --device cuda --timeout 190 --out "$R/suite"
done
LIMIT=240 step gpu_tests python -m pytest -q -m gpu -p no:cacheprovider --durations 5 \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_dsa_cuda.py tests/gpu/test_deepseek_v4_cuda.py \
  tests/gpu/test_deepseek_v4_decode_graphs.py tests/gpu/test_deepseek_decode_graphs.py
tar czf "$OUT/results.tgz" -C "$OUT" r

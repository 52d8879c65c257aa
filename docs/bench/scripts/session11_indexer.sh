#!/usr/bin/env bash
# Session 11, issue 35 item 1 on one H200: the FP8 indexer scores and the radix top-k, their GPU
# tests, the indexer micro-bench (V4's CSA at 128K / 256K / 1M, V3.2's cases) and the per-group
# breakdown of V4-Flash's last 8K chunk of 256K in FP8 and bf16. Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; }
step kernel_tests python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_indexer_kernel.py
step indexer_v4 python -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x8192:131072,1x8192:262144,1x8192:1048576,512x1:262144 --out "$R/indexer_v4.json"
step indexer_v32 python -m app.bench.indexer_select --no-loop --out "$R/indexer_v32.json"
for q in fp8 none; do kv=$([ $q = fp8 ] && echo fp8 || echo auto)
  step breakdown_$q python -m app.bench.deepseek_breakdown --linear auto --quantization $q \
    --kv-cache-dtype $kv --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_$q.json"
done
LIMIT=420 step model_tests python -m pytest -q -m gpu -p no:cacheprovider --durations 10 \
  tests/gpu/test_dsa_cuda.py tests/gpu/test_deepseek_v4_cuda.py tests/gpu/test_deepseek_v4_decode_graphs.py
tar czf "$OUT/results.tgz" -C "$OUT" r

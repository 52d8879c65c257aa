#!/usr/bin/env bash
# Session 14, call 4 (one H200, Ray carried; the last of the device budget, so each step writes
# its log under $OUT/r as it ends): the final tree's GPU checks after the FP8 indexer key layout,
# the query quantizer and the decode launch: the indexer / V3.2 / V4 kernel tests and V4's decode
# graphs (graphed == eager == the general path, the engine's graphed tokens == --enforce-eager's),
# the batched-vs-alone engine test; then the compaction's launch sweep and the FP8 chunk's
# breakdown.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=200 step gpu_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_dsa_cuda.py tests/gpu/test_deepseek_v4_cuda.py \
  tests/gpu/test_deepseek_v4_decode_graphs.py
LIMIT=300 step batched python3 -m pytest -rA -s -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py
LIMIT=40 step topk_sweep python3 docs/bench/scripts/session15_topk_sweep.py --out "$R/topk.jsonl"
LIMIT=45 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

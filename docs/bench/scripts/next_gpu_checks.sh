#!/usr/bin/env bash
# What session 24 left for the GPU host, one H200 (carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw,
# .commit; the engine no longer needs llguidance): the tree's V4-Flash FP8 figures of record
# after session 24's changes (the MoE's prefill launch back to one 128-row program an SM, the
# indexer chunk kernel's register cap, the gathered top-k compaction, none yet measured on an
# H200 nor the last through the engine), the top-k's tie-rule tests on the device with both
# walks, the 256K chunk by groups (now with each MoE layer's expert load), the MoE launches at
# skewed routings, and the 512-row FP8 decode row. DEADLINE (default 580 s).
# The 1M row (`--only ttft-v4-flash-1m-fp8`, ~330 s) and the bf16 decode row
# (`decode-v4-flash-512`, whose headline figure predates the stream merge of c11bcb9) want a call
# each.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=90 step gpu_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_rule_topk_cuda.py
LIMIT=240 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 235 --out "$R/suite"
LIMIT=80 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 \
  --out "$R/breakdown_fp8.json"
# the two MoE prefill launches at routings as skewed as the breakdown's expert_loads say the
# random model's are (session 24: the engine preferred the 128-row launch, the even sweep not)
for skew in 0 1 3; do
  LIMIT=40 step moe_skew_$skew python3 -m app.bench.fp8 --moe-loops --moe-loop-shapes \
    --moe-skew $skew --out "$R/moe_skew_$skew.json"
done
left=$((${DEADLINE:-580} - SECONDS)); LIMIT=$((left < 150 ? left : 150))
[ $left -gt 90 ] && step decode-v4-flash-512-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-512-fp8 --device cuda --timeout $((LIMIT - 5)) --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 27, call 6 (one GPU, whichever comes; carry as call 4; not run: the budget was out):
# first the GPU tests of the kernels now launched with PDL that only ran through V4's paths
# (V3.2's decode graphs and DSA, the indexer, the rule's and the router's top-k); then on an
# H200 the ttft-v4-flash-fp8 rows of record at this tree (PDL, the scales a step ahead); on an
# H100 the fused gate/up MoE at 1-16 decode rows over (warps, stages, gate and up side by side)
# (app.bench.fp8 --moe-swiglu-launches), the V4-Flash FP8 decode step with
# triton_moe_fp8.SWIGLU_SIDE_BY_SIDE on (a copy in /tmp/sbs) against the tree, and the decode
# tile sweep of the grouped GEMMs.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=240 step pdl_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_decode_graphs.py tests/gpu/test_dsa_cuda.py \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_rule_topk_cuda.py tests/gpu/test_route_topk_cuda.py
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  LIMIT=260 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
    --device cuda --timeout 255 --out "$R/suite"
  grep -h "^| " $R/*.log
else
  LIMIT=120 step swiglu_launches python3 -m app.bench.fp8 --moe-swiglu-launches \
    --out "$R/swiglu_launches.json"
  rm -rf /tmp/sbs && mkdir -p /tmp/sbs && cp -r app stages docs /tmp/sbs/
  sed -i 's/^SWIGLU_SIDE_BY_SIDE = False$/SWIGLU_SIDE_BY_SIDE = True/' /tmp/sbs/stages/kernels/triton_moe_fp8.py
  grep -c "^SWIGLU_SIDE_BY_SIDE = True$" /tmp/sbs/stages/kernels/triton_moe_fp8.py
  D="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
  LIMIT=170 step decode_tree $D --out "$R/decode_tree.json"
  LIMIT=110 step decode_sbs bash -c "cd /tmp/sbs && PYTHONPATH=/tmp/site:/tmp/sbs $D --out $R/decode_sbs.json"
  LIMIT=130 step decode_tiles python3 -m app.bench.fp8 --moe-decode-tiles --out "$R/decode_tiles.json"
fi
tar czf "$OUT/results.tgz" -C "$OUT" r

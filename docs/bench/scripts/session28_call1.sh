#!/usr/bin/env bash
# Session 28, call 1 (one GPU, whichever comes; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw,
# .commit): the GPU tests of the kernels launched with PDL that only ran through V4's paths
# (V3.2's decode graphs and DSA, the indexer, the rule's and the router's top-k), the fused
# gate/up GPU test with the side-by-side case, then the fused gate/up MoE at 1-16 decode rows
# over (warps, stages, gate and up side by side) and the V4-Flash FP8 decode step with
# triton_moe_fp8.SWIGLU_SIDE_BY_SIDE on (a copy in /tmp/sbs) against the tree.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=230 step pdl_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_decode_graphs.py tests/gpu/test_dsa_cuda.py \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_rule_topk_cuda.py \
  tests/gpu/test_route_topk_cuda.py tests/gpu/test_fp8_kernels.py -k "not slow"
LIMIT=100 step swiglu_launches python3 -m app.bench.fp8 --moe-swiglu-launches \
  --out "$R/swiglu_launches.json"
rm -rf /tmp/sbs && mkdir -p /tmp/sbs && cp -r app stages docs /tmp/sbs/
sed -i 's/^SWIGLU_SIDE_BY_SIDE = False$/SWIGLU_SIDE_BY_SIDE = True/' /tmp/sbs/stages/kernels/triton_moe_fp8.py
grep -c "^SWIGLU_SIDE_BY_SIDE = True$" /tmp/sbs/stages/kernels/triton_moe_fp8.py
D="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
left=$((${DEADLINE:-585} - SECONDS)); LIMIT=$(( (left - 10) / 2 )) step decode_tree $D --out "$R/decode_tree.json"
left=$((${DEADLINE:-585} - SECONDS)); LIMIT=$((left - 5)) step decode_sbs bash -c "cd /tmp/sbs && PYTHONPATH=/tmp/site:/tmp/sbs $D --out $R/decode_sbs.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

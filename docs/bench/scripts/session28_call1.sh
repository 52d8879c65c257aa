#!/usr/bin/env bash
# Session 28, call 1 (one GPU, whichever comes; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw,
# .commit, .ab): the GPU tests of the kernels launched with PDL that only ran through V4's paths
# (V3.2's decode graphs and DSA, the indexer, the rule's and the router's top-k), the fused
# gate/up's (with the side-by-side case) and the hyper-connections' (the comb summed as
# [S, T, N * N]); the fused gate/up MoE at 1-16 decode rows over (warps, stages, side by side);
# the V4-Flash FP8 decode step, interleaved: the tree, a copy with
# triton_moe_fp8.SWIGLU_SIDE_BY_SIDE on (/tmp/sbs), a copy with the hyper-connections' _finish
# before this session (.ab/triton_hyper_base.py, /tmp/hcbase).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=230 step pdl_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_decode_graphs.py tests/gpu/test_dsa_cuda.py \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_rule_topk_cuda.py \
  tests/gpu/test_route_topk_cuda.py tests/gpu/test_fp8_kernels.py tests/gpu/test_triton_hyper.py \
  -k "not slow"
LIMIT=100 step swiglu_launches python3 -m app.bench.fp8 --moe-swiglu-launches \
  --out "$R/swiglu_launches.json"
for v in sbs hcbase; do rm -rf /tmp/$v && mkdir -p /tmp/$v && cp -r app stages docs /tmp/$v/; done
sed -i 's/^SWIGLU_SIDE_BY_SIDE = False$/SWIGLU_SIDE_BY_SIDE = True/' /tmp/sbs/stages/kernels/triton_moe_fp8.py
grep -c "^SWIGLU_SIDE_BY_SIDE = True$" /tmp/sbs/stages/kernels/triton_moe_fp8.py
cp .ab/triton_hyper_base.py /tmp/hcbase/stages/kernels/triton_hyper.py
D="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
for round in 1 2; do
  for v in tree sbs hcbase; do
    left=$((${DEADLINE:-585} - SECONDS)); [ $left -lt 40 ] && break 2
    dir=$PWD; [ $v = tree ] || dir=/tmp/$v
    LIMIT=$((left < 90 ? left - 5 : 90)) step decode_${v}_$round bash -c \
      "cd $dir && PYTHONPATH=/tmp/site:$dir $D --out $R/decode_${v}_$round.json"
  done
done
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

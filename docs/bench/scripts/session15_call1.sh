#!/usr/bin/env bash
# Session 15, call 1 (one H200; carry .gpu .whl .tfw .commit): the kernels written without a
# device in session 15 -- group_pool (V4's compressor), the MoE combine, fp8_swiglu_linear, the
# top-k compaction over group maxima, route_topk, FlashMLA's shared V4 state, the decode step's
# index kernels, the hyper-connection mix with its norm, rope_angles -- against their torch forms, with the kernel tests they
# touch (indexer, V3.2, V4, FP8, MoE, MXFP4); the top-k launch sweep; then the V4 decode stage
# in graphs (group_pool's skip of the padded groups is the 512-row figure's expected gain) and
# the FP8 chunk's breakdown. Each step's log lands under $OUT/r as it ends.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=300 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_group_pool_cuda.py tests/gpu/test_moe_combine_cuda.py tests/gpu/test_fp8_kernels.py \
  tests/gpu/test_route_topk_cuda.py tests/gpu/test_flash_mla_v4.py tests/gpu/test_v4_paged_index_cuda.py \
  tests/gpu/test_triton_hyper.py tests/gpu/test_triton_rope.py \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_dsa_cuda.py tests/gpu/test_deepseek_v4_cuda.py \
  tests/gpu/test_mla_moe_kernels.py tests/gpu/test_mxfp4_moe.py
LIMIT=60 step topk_sweep python3 docs/bench/scripts/session15_topk_sweep.py --out "$R/topk.jsonl"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
LIMIT=50 step v4_decode_bf16 python3 -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --out "$R/v4_decode_bf16.json"
LIMIT=50 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

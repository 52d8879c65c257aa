#!/usr/bin/env bash
# Session 21, call 1 (one H200; carry .gpu .whl .tfw .commit): the GPU tests and A/Bs of session
# 20's kernel changes -- the MoE's fused SwiGLU epilogue below UNFUSED_SWIGLU_FROM tokens only,
# its unfused quantizer on live rows only, the rule's one-program top-k up to
# RULE_KERNEL_MAX_LINES lines only, the grouped W8A8 GEMM through TMA descriptors (tma=True, not
# yet the default), the Gluon grouped GEMM with each K block's MMA overlapped (session 21, built
# without a device: against the Triton one, and in the tile sweep as "gluon") -- at the
# crossovers; then the V4 decode stage in graphs (FP8, 1/64/512) and
# the last 8K chunk of 256K by groups. Defaults flipped by what this call finds are measured
# through the engine by call 4.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
F=tests/gpu/test_fp8_kernels.py
LIMIT=100 step gpu_tests $GPU_PYTEST $F::test_fp8_experts_match_reference \
  $F::test_fused_gate_up_swiglu_equals_the_unfused_path $F::test_gluon_grouped_gemm_equals_the_triton_one \
  tests/gpu/test_indexer_kernel.py::test_gluon_chunk_scores_equal_the_triton_kernel \
  tests/gpu/test_rule_topk_cuda.py \
  tests/gpu/test_indexer_kernel.py::test_tie_rule_on_cuda_is_a_stable_sort
LIMIT=45 step moe_swiglu python3 -m app.bench.fp8 --moe-swiglu --out "$R/moe_swiglu.json"
LIMIT=60 step moe_tiles python3 -m app.bench.fp8 --moe-tiles --out "$R/moe_tiles.json"
LIMIT=70 step moe_decode_tiles python3 -m app.bench.fp8 --moe-decode-tiles \
  --out "$R/moe_decode_tiles.json"
LIMIT=60 step rule_topk python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x1:2304,512x1:2304,1x1024:32768,1x2048:65536,1x8192:262144 \
  --out "$R/indexer_select.json"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
LIMIT=30 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 \
  --out "$R/breakdown_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

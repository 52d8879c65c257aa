#!/usr/bin/env bash
# Session 31, call 1 (one H100 or H200; carry .whl/sgl_flash_mla-*.whl, .tfw, .commit,
# .gpu-deepgemm: Ray's .gpu comes with call 2, the carry's 64 MiB holding not all of them):
# DeepGEMM built from source (Ubuntu's g++), then the deepgemm moe_experts_fp8
# backend (stages/kernels/deepgemm_moe.py): its GPU tests (bits equal to triton-persistent's,
# the FP8 reference, alone against batched across the prefill threshold) beside the FP8 MoE and
# combine tests the unweighted down rows touch; the MoE step both ways (app.bench.deepgemm); the
# 256K last chunk by groups without deep_gemm on the path (triton-persistent) and with it
# (deepgemm, auto's first). Call 2 (session31_call2.sh) runs the TTFT rows on the warm machine.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
use_deepgemm 120
LIMIT=150 step gpu_tests /tmp/with_dg python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepgemm_moe_cuda.py tests/gpu/test_moe_combine_cuda.py \
  tests/gpu/test_fp8_kernels.py -k "deepgemm or combine or experts or grouped or swiglu"
LIMIT=90 step dg_bench /tmp/with_dg python3 -m app.bench.deepgemm --skip-dense --out "$R/deepgemm.json"
CASE=deepseek-v4-flash:8:262144:8192:512:512
LIMIT=75 step breakdown_triton python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --out "$R/breakdown_triton.json"
LIMIT=75 step breakdown_deepgemm /tmp/with_dg python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --out "$R/breakdown_deepgemm.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"  # one file back (a call returns a few files only)

#!/usr/bin/env bash
# One H200, session 6, third call: the FP8 kernels' GPU tests with the dequantizing prefill
# backend (flash_mla.mla_sparse_fp8_via_bf16), V3.2 on CUDA and FP8 decode graphs == eager; the
# V3.2-bench FP8 prefill stage under the stand-in on it; V3.2-bench FP8 TTFT at 64K and 128K on
# it (--fp8-prefill-attention auto = flash-mla-bf16). Carry .gpu and .wt/lead.
set -uo pipefail
NAME=session6c BUDGET=${BUDGET:-500}
. docs/bench/scripts/session_steps.sh

step gpu tests: FP8 kernels, V3.2 on CUDA, DeepSeek decode graphs
timeout "$(left 150)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/gpu/test_fp8_kernels.py tests/gpu/test_dsa_cuda.py tests/gpu/test_deepseek_decode_graphs.py \
    > "$RES/gpu_tests_fp8_prefill.log" 2>&1
grep -B2 -A8 "^E  " "$RES/gpu_tests_fp8_prefill.log" | head -60 > "$RES/gpu_tests_fp8_prefill_errors.log"
tail -8 "$RES/gpu_tests_fp8_prefill.log" | tee -a "$LOG"
pack

step V3.2-bench FP8 prefill stage under the stand-in, dequantizing prefill
timeout "$(left 80)" python3 -m app.bench.deepseek_breakdown --standin --quantization fp8 \
    --kv-cache-dtype fp8 --linear auto --cases deepseek-v32-bench:4:65536:4096:512:4096 \
    --out "$RES/deepseek_v32_standin_fp8_via_bf16.json" 2>&1 | tail -c 200 | tee -a "$LOG"
pack

step V3.2-bench FP8 TTFT, dequantizing prefill
timeout "$(left 150)" python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
    --linear auto --runs 65536:4096,131072:8192 --modes auto --reps 1 --quantization fp8 \
    --kv-cache-dtype fp8 --out "$RES/deepseek_v32_pp1_ttft_fp8_via_bf16.json" 2>&1 \
    | grep "TTFT\|loaded\|Error" | tee -a "$LOG"
pack
step done

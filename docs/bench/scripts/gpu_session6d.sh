#!/usr/bin/env bash
# One H200, session 6, fourth call: the GPU tests after the FP8 indexer keys' scale moved out of
# the head loop and V4's chunks took the dequantized bf16 prefill path; the V3.2-bench and
# V4-Flash FP8 prefill stages under the stand-in on them; FP8 TTFT of both (V3.2-bench 64K /
# 128K / 256K, V4-Flash 64K / 128K / 256K). Carry .gpu and .wt/lead.
set -uo pipefail
NAME=session6d BUDGET=${BUDGET:-450}
. docs/bench/scripts/session_steps.sh

step gpu tests: indexer kernels, FP8 kernels, V4 kernels, V4 and V3.2 on CUDA
timeout "$(left 130)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/gpu/test_indexer_kernel.py tests/gpu/test_fp8_kernels.py tests/gpu/test_flash_mla_v4.py \
    tests/gpu/test_deepseek_v4_cuda.py tests/gpu/test_dsa_cuda.py > "$RES/gpu_tests_6d.log" 2>&1
grep -B2 -A8 "^E  " "$RES/gpu_tests_6d.log" | head -60 > "$RES/gpu_tests_6d_errors.log"
tail -8 "$RES/gpu_tests_6d.log" | tee -a "$LOG"
pack

for case in deepseek-v32-bench:4:65536:4096:512:4096 deepseek-v4-flash:8:131072:8192:512:512; do
    step "FP8 prefill stage under the stand-in: $case"
    timeout "$(left 60)" python3 -m app.bench.deepseek_breakdown --standin --quantization fp8 \
        --kv-cache-dtype fp8 --linear auto --cases "$case" \
        --out "$RES/standin_fp8_${case%%:*}.json" 2>&1 | tail -c 150 | tee -a "$LOG"
    pack
done

step V4-Flash shape FP8 TTFT
timeout "$(left 90)" python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 \
    --linear auto --runs 65536:8192,131072:8192,262144:8192 --modes auto --reps 1 \
    --quantization fp8 --kv-cache-dtype fp8 --out "$RES/deepseek_v4_flash_pp1_ttft_fp8.json" \
    2>&1 | grep "TTFT\|loaded\|Error" | tee -a "$LOG"
pack

step V3.2-bench FP8 TTFT
timeout "$(left 160)" python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
    --linear auto --runs 65536:4096,131072:8192,262144:8192 --modes auto --reps 1 \
    --quantization fp8 --kv-cache-dtype fp8 --out "$RES/deepseek_v32_pp1_ttft_fp8.json" \
    2>&1 | grep "TTFT\|loaded\|Error" | tee -a "$LOG"
pack
step done

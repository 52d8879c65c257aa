#!/usr/bin/env bash
# One H200, session 6, first call: the GPU tests of DeepSeek-V4 with FP8 weights (the FP8 experts
# under the swiglu clamp, the V4-shaped stage FP8 against bf16) and of V4 on CUDA; FP8 against
# bf16 accuracy on the small V4; the V4-Flash shape's PP=1 TTFT at 64K / 128K / 256K with FP8
# weights + the FP8 cache, then in bf16 on the same code. Carry .gpu and .wt/lead.
set -uo pipefail
NAME=session6 BUDGET=${BUDGET:-560}
. docs/bench/scripts/session_steps.sh

step gpu tests: FP8 experts with the swiglu clamp, V4 stage FP8, V4 on CUDA
timeout "$(left 120)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/gpu/test_fp8_kernels.py tests/gpu/test_deepseek_v4_cuda.py tests/gpu/test_flash_mla_v4.py \
    > "$RES/gpu_tests_v4_fp8.log" 2>&1
grep -B2 -A8 "^E  " "$RES/gpu_tests_v4_fp8.log" | head -60 > "$RES/gpu_tests_v4_fp8_errors.log"
tail -8 "$RES/gpu_tests_v4_fp8.log" | tee -a "$LOG"
pack

step FP8 against bf16 on the small V4
timeout "$(left 80)" python3 -m app.bench.fp8 --skip-gemm --models v4 --prompt-len 512 \
    --out "$RES/fp8_accuracy_v4.json" 2>&1 | grep "^{" | tee -a "$LOG"
pack

for q in fp8 none; do
    kv=$([ "$q" = fp8 ] && echo fp8 || echo auto)
    step "V4-Flash shape TTFT, --quantization $q --kv-cache-dtype $kv"
    timeout "$(left 170)" python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 \
        --linear auto --runs 65536:8192,131072:8192,262144:8192 --modes auto --reps 1 \
        --quantization "$q" --kv-cache-dtype "$kv" \
        --out "$RES/deepseek_v4_flash_pp1_ttft_$q.json" 2>&1 | grep "TTFT\|loaded\|Error" | tail -6 | tee -a "$LOG"
    pack
done
step done

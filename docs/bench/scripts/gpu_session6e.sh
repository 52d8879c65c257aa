#!/usr/bin/env bash
# One H200, session 6, last call: the grouped FP8 MoE on 128-row tiles, 8 warps, 4 stages (the
# tile sweep's best): its GPU tests, then V4-Flash and V3.2-bench FP8 TTFT. Carry .gpu, .wt/lead.
set -uo pipefail
NAME=session6e BUDGET=${BUDGET:-240}
. docs/bench/scripts/session_steps.sh
step gpu tests: FP8 experts, V4 and V3.2 stages FP8, FP8 decode graphs
timeout "$(left 70)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_fp8_kernels.py \
    tests/gpu/test_deepseek_decode_graphs.py -k "experts or stage or fp8" > "$RES/gpu_tests_6e.log" 2>&1
tail -4 "$RES/gpu_tests_6e.log" | tee -a "$LOG"; pack
step V4-Flash shape FP8 TTFT
timeout "$(left 80)" python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 \
    --linear auto --runs 65536:8192,131072:8192,262144:8192 --modes auto --reps 1 \
    --quantization fp8 --kv-cache-dtype fp8 --out "$RES/deepseek_v4_flash_pp1_ttft_fp8_tiles.json" \
    2>&1 | grep "TTFT\|loaded\|Error" | tee -a "$LOG"; pack
step V3.2-bench FP8 TTFT
timeout "$(left 70)" python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
    --linear auto --runs 65536:4096,131072:8192 --modes auto --reps 1 \
    --quantization fp8 --kv-cache-dtype fp8 --out "$RES/deepseek_v32_pp1_ttft_fp8_tiles.json" \
    2>&1 | grep "TTFT\|loaded\|Error" | tee -a "$LOG"; pack
step done

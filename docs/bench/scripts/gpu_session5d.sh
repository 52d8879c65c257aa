#!/usr/bin/env bash
# One H200, session 5, fourth call (after the merge of v4host and the hyper-connection
# precision choice): the hyper-connection and V4-on-CUDA GPU tests; the hyper-connection kernels
# alone and under the stand-in per projection precision; the V4-Flash shape's breakdown under the
# stand-in; V4-Flash decode at 512 rows; V3.2-bench FP8 TTFT (fused quantizer, FP8 indexer keys)
# and FP8 decode at 512 rows graphed with the FP8 indexer keys. Carry .gpu and .wt/lead.
set -uo pipefail
NAME=session5d BUDGET=${BUDGET:-450}
. docs/bench/scripts/session_steps.sh

step gpu tests: hyper-connections, V4 on CUDA
timeout "$(left 70)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/gpu/test_triton_hyper.py tests/gpu/test_deepseek_v4_cuda.py > "$RES/gpu_tests_hyper.log" 2>&1
grep -B2 -A6 "Mismatch\|^E  " "$RES/gpu_tests_hyper.log" | head -40 > "$RES/gpu_tests_hyper_errors.log"
tail -12 "$RES/gpu_tests_hyper.log" | tee -a "$LOG"
pack

step hyper-connection kernels alone and under the stand-in
timeout "$(left 60)" python3 -m app.bench.standin_kernels --groups hyper \
    --out "$RES/standin_hyper.json" 2>&1 | quiet 12
pack

step V4-Flash shape under the stand-in
timeout "$(left 60)" python3 -m app.bench.deepseek_breakdown --standin \
    --cases deepseek-v4-flash:8:131072:8192:512:512 \
    --out "$RES/deepseek_v4_standin_final.json" 2>&1 | tail -c 200 | tee -a "$LOG"
pack

step V4-Flash shape decode at 512 rows
timeout "$(left 80)" python3 -m app.bench.load --model-shape deepseek-v4-flash --pp 1 \
    --device cuda --parts decode --decode-concurrency 512 --short-len 512 \
    --decode-tokens 16 --reps 1 --decode-modes auto --run-ahead --linear auto \
    --out "$RES/deepseek_v4_flash_decode_512.json" 2>&1 | quiet 5
pack

step V3.2-bench FP8 TTFT, fused quantizer and FP8 indexer keys
timeout "$(left 70)" python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
    --linear auto --runs 65536:4096,131072:8192 --modes auto --reps 1 \
    --quantization fp8 --kv-cache-dtype fp8 --out "$RES/deepseek_v32_pp1_ttft_fp8_final.json" \
    2>&1 | quiet 5
pack

step V3.2-bench FP8 decode at 512 rows graphed, FP8 indexer keys
timeout "$(left 90)" python3 -m app.bench.load --model-shape deepseek-v32-bench --pp 1 \
    --device cuda --parts decode --decode-concurrency 512 --decode-tokens 64 --reps 1 \
    --decode-modes auto --run-ahead --no-reference --quantization fp8 --kv-cache-dtype fp8 \
    --out "$RES/deepseek_v32_fp8_decode_512_graphs_final.json" 2>&1 | quiet 5
pack
step done

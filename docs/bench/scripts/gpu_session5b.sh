#!/usr/bin/env bash
# One H200, session 5, second call (after the merges of fp8graph and the V4 hyper-connection
# kernels): the GPU tests of FP8 decode graphs, the fused activation quantizer and the Triton
# hyper-connections; V3.2-bench FP8 decode at 512 rows graphed; the V4-Flash shape's breakdown
# under the stand-in again (Triton hyper-connections); V2-Lite 32K TTFT with the dense-MLA cuDNN
# warm-up, and V2-Lite decode at 512 rows run long enough to be decode-bound. Each step's limit is
# cut to what is left of one call (BUDGET seconds). Carry .gpu (Ray) and .wt/lead.
set -uo pipefail
NAME=session5b BUDGET=${BUDGET:-560}
. docs/bench/scripts/session_steps.sh

step gpu tests: hyper-connections, V4 on CUDA
timeout "$(left 60)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/gpu/test_triton_hyper.py tests/gpu/test_deepseek_v4_cuda.py 2>&1 | tail -15 \
    | tee "$RES/gpu_tests_hyper.log" | tee -a "$LOG"
pack

step gpu tests: FP8 quantizer, W8A8, FP8 experts, decode graphs incl. FP8
F=tests/gpu/test_fp8_kernels.py
timeout "$(left 200)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    "$F::test_fused_activation_quantizer_matches_reference" \
    "$F::test_w8a8_linear_matches_reference" "$F::test_fp8_experts_match_reference" \
    "$F::test_v32_stage_fp8_against_bf16" tests/gpu/test_deepseek_decode_graphs.py 2>&1 \
    | grep -v "^(raylet)" | tail -30 | tee "$RES/gpu_tests_fp8_graphs.log" | tail -8 | tee -a "$LOG"
pack

step V4-Flash shape under the stand-in, Triton hyper-connections
timeout "$(left 70)" python3 -m app.bench.deepseek_breakdown --standin \
    --cases deepseek-v4-flash:8:131072:8192:512:512 \
    --out "$RES/deepseek_v4_standin_hc.json" 2>&1 | tail -c 600 | tee -a "$LOG"
pack

step V3.2-bench decode at 512 rows, FP8 weights + FP8 KV, graphed
timeout "$(left 110)" python3 -m app.bench.load --model-shape deepseek-v32-bench --pp 1 \
    --device cuda --parts decode --decode-concurrency 512 --decode-tokens 64 --reps 1 \
    --decode-modes auto --run-ahead --no-reference --quantization fp8 --kv-cache-dtype fp8 \
    --out "$RES/deepseek_v32_fp8_decode_512_graphs.json" 2>&1 | quiet 6
pack

step V2-Lite 32K PP=1 TTFT, dense-MLA cuDNN warm-up
timeout "$(left 70)" python3 -m app.bench.engine --model-shape deepseek-v2-lite --pp 1 \
    --linear triton-persistent --runs 32768:4096 --modes auto --reps 3 \
    --out "$RES/deepseek_v2_lite_pp1_32k.json" 2>&1 | quiet 4
pack

step V2-Lite decode at 512 rows, 256 tokens each
timeout "$(left 80)" python3 -m app.bench.load --model-shape deepseek-v2-lite --pp 1 \
    --device cuda --parts decode --decode-concurrency 512 --decode-tokens 256 --reps 1 \
    --decode-modes auto --run-ahead --out "$RES/deepseek_v2_lite_decode_512_steady.json" 2>&1 \
    | quiet 6
pack
step done

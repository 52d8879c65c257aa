#!/usr/bin/env bash
# One H200, session 5, last call: the hyper-connection GPU tests with bf16x3 as the default
# projection, then the V4-Flash shape's PP=1 TTFT at 64K and 128K on it. Carry .gpu, .wt/lead.
set -uo pipefail
NAME=session5e BUDGET=${BUDGET:-180}
. docs/bench/scripts/session_steps.sh
timeout 45 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_triton_hyper.py \
    2>&1 | tail -4 | tee "$OUT/gpu_tests_hyper_bf16x3.log"
timeout 110 python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto \
    --runs 65536:8192,131072:8192 --modes auto --reps 1 \
    --out "$OUT/deepseek_v4_flash_pp1_hc.json" 2>&1 | grep "TTFT\|loaded" | tail -4

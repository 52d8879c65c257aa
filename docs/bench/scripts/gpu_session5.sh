#!/usr/bin/env bash
# One H200, session 5, first call: the DeepSeek kernels under the one-GPU pending-recv stand-in
# (the kernel table, and the V4-Flash shape's prefill chunk and decode step per op group), then
# V3.2-bench PP=1 TTFT at 64K / 128K / 256K in bf16 and with FP8 weights + FP8 KV on the same
# code. Each step's limit is cut to what is left of one 10-minute call (BUDGET seconds).
# Carry .gpu (Ray) and .wt/lead (sgl-flash-mla). Results are packed into one archive after
# every step (at most 8 files come back from $OUT).
set -uo pipefail
NAME=session5 BUDGET=${BUDGET:-560}
. docs/bench/scripts/session_steps.sh

step kernels alone and under the stand-in
timeout "$(left 100)" python3 -m app.bench.standin_kernels --out "$RES/standin_kernels.json" \
    2>&1 | quiet 40
pack

step V4-Flash shape under the stand-in: 8K chunk at 128K, decode 512 rows at 512
timeout "$(left 130)" python3 -m app.bench.deepseek_breakdown --standin \
    --cases deepseek-v4-flash:8:131072:8192:512:512 \
    --out "$RES/deepseek_v4_standin.json" 2>&1 | tail -c 1200 | tee -a "$LOG"
pack

for q in none fp8; do
    kv=auto; [ "$q" = fp8 ] && kv=fp8
    step V3.2-bench PP=1 TTFT, quantization $q, KV $kv
    timeout "$(left 150)" python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
        --linear auto --runs 65536:4096,131072:8192,262144:8192 --modes auto --reps 1 \
        --quantization "$q" --kv-cache-dtype "$kv" \
        --out "$RES/deepseek_v32_pp1_ttft_$q.json" 2>&1 | quiet 8
    pack
done
step done

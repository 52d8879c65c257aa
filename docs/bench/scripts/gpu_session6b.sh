#!/usr/bin/env bash
# One H200, session 6, second call: V4-Flash shape decode at 512 rows with FP8 weights + the FP8
# cache and in bf16, the KV sized by the engine (--kv-blocks memory: the capacity is the
# deployment's); the V3.2-bench and V4-Flash prefill stages with FP8 weights + FP8 KV under the
# pending-recv stand-in (op groups); V3.2-bench FP8 TTFT at 128K; V2-Lite's first 32K prompt
# after the warm-up's V-stride mend. Carry .gpu and .wt/lead.
set -uo pipefail
NAME=session6b BUDGET=${BUDGET:-570}
. docs/bench/scripts/session_steps.sh

for q in fp8 none; do
    kv=$([ "$q" = fp8 ] && echo fp8 || echo auto)
    step "V4-Flash shape decode at 512 rows, --quantization $q --kv-cache-dtype $kv"
    timeout "$(left 90)" python3 -m app.bench.load --model-shape deepseek-v4-flash --pp 1 \
        --device cuda --parts decode --decode-concurrency 512 --short-len 512 \
        --decode-tokens 16 --reps 1 --decode-modes auto --run-ahead --linear auto \
        --quantization "$q" --kv-cache-dtype "$kv" --kv-blocks memory \
        --out "$RES/deepseek_v4_flash_decode_512_$q.json" 2>&1 | quiet 5
    pack
done

step V3.2-bench FP8 prefill stage under the stand-in
timeout "$(left 80)" python3 -m app.bench.deepseek_breakdown --standin --quantization fp8 \
    --kv-cache-dtype fp8 --linear auto --cases deepseek-v32-bench:4:65536:4096:512:4096 \
    --out "$RES/deepseek_v32_standin_fp8.json" 2>&1 | tail -c 300 | tee -a "$LOG"
pack
step V3.2-bench bf16 prefill stage under the stand-in, same case
timeout "$(left 80)" python3 -m app.bench.deepseek_breakdown --standin --linear auto \
    --cases deepseek-v32-bench:4:65536:4096:512:4096 \
    --out "$RES/deepseek_v32_standin_bf16.json" 2>&1 | tail -c 300 | tee -a "$LOG"
pack
step V4-Flash FP8 prefill stage under the stand-in
timeout "$(left 80)" python3 -m app.bench.deepseek_breakdown --standin --quantization fp8 \
    --kv-cache-dtype fp8 --linear auto --cases deepseek-v4-flash:8:131072:8192:512:512 \
    --out "$RES/deepseek_v4_standin_fp8.json" 2>&1 | tail -c 300 | tee -a "$LOG"
pack

step V3.2-bench FP8 TTFT at 128K
timeout "$(left 90)" python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
    --linear auto --runs 131072:8192 --modes auto --reps 1 --quantization fp8 \
    --kv-cache-dtype fp8 --out "$RES/deepseek_v32_pp1_ttft_fp8_128k.json" 2>&1 | grep "TTFT\|loaded" | tee -a "$LOG"
pack

step V2-Lite 32K PP=1 TTFT, first prompt after the warm-up
timeout "$(left 70)" python3 -m app.bench.engine --model-shape deepseek-v2-lite --pp 1 \
    --linear triton-persistent --runs 32768:4096 --modes auto --reps 3 \
    --out "$RES/deepseek_v2_lite_pp1_32k.json" 2>&1 | grep "TTFT\|loaded" | tee -a "$LOG"
pack
step done

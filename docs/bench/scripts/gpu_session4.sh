#!/usr/bin/env bash
# One H200, after the session-4 merges (V4 on FlashMLA, V4 rows batched, DeepSeek decode graphs,
# FP8 kernels on the shared GEMM walk, the copy channel's shm hand-over): the GPU tests those
# merges touch, then the deepseek-v4-flash shape (8 leading layers of V4-Flash, bf16) PP=1 TTFT
# at 64K/128K/256K and decode at 64 and 512 rows, V3.2-bench decode at 512 rows run long enough
# to be decode-bound, and the V4 per-op breakdown. Each step's limit is cut to what is left of
# one 10-minute call (BUDGET seconds). Carry .gpu (Ray) and .wt/lead (sgl-flash-mla, llguidance).
# At most 8 files come back from $OUT: the script writes 7.
set -uo pipefail
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wt/lead/whl/*.whl \
    2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-570}
LOG="$OUT/session4_bench.log"
left() {  # seconds for a step: its cap, or what is left of BUDGET
    local l=$((BUDGET - SECONDS)); [ "$l" -lt "$1" ] && echo $((l > 5 ? l : 5)) || echo "$1"
}
step() { echo "=== [$SECONDS s] $*" | tee -a "$LOG"; }
quiet() { grep -v "^(raylet)\|WARNING\|INFO worker" | tail -"$1" | tee -a "$LOG"; }

step gpu tests
timeout "$(left 150)" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_flash_mla_v4.py tests/gpu/test_deepseek_v4_cuda.py \
    tests/gpu/test_copy_channel.py tests/gpu/test_decode_graphs.py \
    tests/gpu/test_deepseek_decode_graphs.py tests/gpu/test_engine_cuda.py 2>&1 | tail -25 \
    | tee "$OUT/gpu_tests_session4.log"

step V4-Flash shape, PP=1 TTFT
timeout "$(left 200)" python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 \
    --linear auto --runs 65536:8192,131072:8192,262144:8192 --modes auto --reps 1 \
    --out "$OUT/deepseek_v4_flash_pp1.json" 2>&1 | quiet 8

for c in 64 512; do
    step V4-Flash shape, decode at $c rows
    timeout "$(left 90)" python3 -m app.bench.load --model-shape deepseek-v4-flash --pp 1 \
        --device cuda --parts decode --decode-concurrency "$c" --short-len 512 \
        --decode-tokens 16 --reps 1 --decode-modes auto --run-ahead --linear auto \
        --out "$OUT/deepseek_v4_flash_decode_$c.json" 2>&1 | quiet 5
done

step V3.2-bench decode at 512 rows, 256 tokens each
timeout "$(left 80)" python3 -m app.bench.load --model-shape deepseek-v32-bench --pp 1 \
    --device cuda --parts decode --decode-concurrency 512 --decode-tokens 256 --reps 1 \
    --decode-modes auto --run-ahead --out "$OUT/deepseek_v32_decode_512_steady.json" 2>&1 \
    | quiet 6

step V4 breakdown: an 8K chunk at the end of a 128K prompt, a decode step of 512 rows
timeout "$(left 150)" python3 -m app.bench.deepseek_breakdown \
    --cases deepseek-v4-flash:8:131072:8192:512:512 \
    --out "$OUT/deepseek_v4_breakdown.json" 2>&1 | tail -c 1500 | tee -a "$LOG"
step done

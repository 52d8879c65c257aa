#!/usr/bin/env bash
# One H200: DeepSeek-V4 (issue 22 item 5). The V4 GPU tests, then the deepseek-v4-flash shape
# (V4-Flash in bf16, its 8 leading layers: app/bench/target.py) — PP=1 TTFT at 64K, 128K and
# 256K; decode tok/s at 64 and 512 rows; the per-op breakdown (CUDA events per V4 op, kernel
# groups, launches) of one prefill chunk at the end of a 256K prompt and of one decode step at
# 64 and 512 rows; the hidden channel's bytes and one device copy of an 8K chunk
# ([8192, 4, 4096] bf16; in the breakdown JSON). Carry .gpu (Ray) and .wt/lead (the
# sgl-flash-mla and llguidance wheels). Run from the repository root (from a copy under .wt/NAME:
# `ln -s ../../.gpu .gpu; mkdir -p .wt; ln -s ../../lead .wt/lead` first); JSON and logs under $OUT.
# Overrides (the smoke run's): RUNS, DECODE_ROWS, SHORT_LEN, DECODE_TOKENS, BREAKDOWN, LINEAR;
# PARTS picks steps (default "tests breakdown engine decode"): the full set at 256K outlasts one
# 10-minute device call, so run it as e.g. PARTS=breakdown, PARTS=engine, PARTS="tests decode".
set -uo pipefail
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wt/lead/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUNS=${RUNS:-65536:8192,131072:8192,262144:8192}
DECODE_ROWS=${DECODE_ROWS:-64 512}
SHORT_LEN=${SHORT_LEN:-512}
DECODE_TOKENS=${DECODE_TOKENS:-32}
BREAKDOWN=${BREAKDOWN:-deepseek-v4-flash:8:262144:8192:64:1024,deepseek-v4-flash:8:8192:8192:512:256}
LINEAR=${LINEAR:-triton-persistent}
PARTS=${PARTS:-tests breakdown engine decode}
part() { [[ " $PARTS " == *" $1 "* ]]; }
part tests && timeout 120 python3 -m pytest -q -m gpu \
    tests/gpu/test_deepseek_v4_cuda.py -p no:cacheprovider 2>&1 | tail -20 \
    | tee "$OUT/gpu_tests_v4.log"
part breakdown && timeout 570 python3 -m app.bench.deepseek_breakdown --cases "$BREAKDOWN" \
    --out "$OUT/deepseek_v4_breakdown.json" 2>&1 | tail -c 3000 | tee "$OUT/deepseek_v4_breakdown.log"
part engine && timeout 570 python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 \
    --linear "$LINEAR" --runs "$RUNS" --modes auto --reps 1 \
    --out "$OUT/deepseek_v4_flash_pp1.json" 2>&1 | grep -v "^(raylet)" | tail -12 \
    | tee "$OUT/deepseek_v4_flash_pp1.log"
part decode && for c in $DECODE_ROWS; do
  timeout 400 python3 -m app.bench.load --model-shape deepseek-v4-flash --pp 1 --device cuda \
      --parts decode --decode-concurrency "$c" --short-len "$SHORT_LEN" \
      --decode-tokens "$DECODE_TOKENS" --reps 1 --decode-modes auto --run-ahead \
      --linear "$LINEAR" --out "$OUT/deepseek_v4_flash_decode_$c.json" 2>&1 \
      | grep -v "^(raylet)" | tail -6 | tee "$OUT/deepseek_v4_flash_decode_$c.log"
done

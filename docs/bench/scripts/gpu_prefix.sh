#!/usr/bin/env bash
# Issue 14 on one H200: `ppserve bench prefix` on Llama-3-8B shapes with random weights (PP=1 by
# default, PP=2 with PP=2 and two GPUs): a 64K and a 128K document each followed by 4 questions
# of 256 tokens, an 8-turn chat replay growing to 32K, 8 distinct 16K prompts; prefix caching
# off, then on (one pipeline load each). About 4-5 minutes at PP=1. Carry .gpu (Ray); the JSON
# and the log go to $OUT.
set -uo pipefail
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/raysite.tar.xz
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PP=${PP:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.log"
timeout 460 python3 -m app.bench.prefix --pp "$PP" --device cuda --docs 65536,131072 \
    --questions 4 --question-len 256 --chat-turns 8 --chat-len 32768 --chat-reply 64 \
    --distinct 8 --distinct-len 16384 --chunk-size 8192 --reps 1 \
    --out "$OUT/prefix_pp$PP.json" 2>&1 | grep -v "^(raylet)" > "$OUT/prefix_pp$PP.log"
tail -25 "$OUT/prefix_pp$PP.log"

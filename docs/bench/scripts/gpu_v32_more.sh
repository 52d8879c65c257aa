#!/usr/bin/env bash
# One H200: the V3.2-shaped model's 256K TTFT with the persistent Triton GEMMs and MoE, and its
# decode throughput at 512 and 1,024 concurrent rows (16-token prompts: the rows attend densely
# through the sparse kernel). Carry .gpu and .whl.
set -uo pipefail
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for c in ${DECODE_ROWS-512 1024}; do
  timeout 100 python3 -m app.bench.load --model-shape deepseek-v32-bench --pp 1 --device cuda \
      --parts decode --decode-concurrency $c --decode-tokens 16 --reps 1 --decode-modes auto \
      --run-ahead --out "$OUT/deepseek_v32_decode_$c.json" 2>&1 | grep -v "^(raylet)" | tail -3
done
timeout 170 python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 \
    --linear triton-persistent --runs 262144:8192 --modes auto --reps 1 \
    --out "$OUT/deepseek_v32_pp1_256k.json" 2>&1 | grep -v "^(raylet)" | tail -3

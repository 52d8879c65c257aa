#!/usr/bin/env bash
# One H200: every GPU test that fits one GPU, then `bench serve` (PP=1, 16K/32K prompts at
# 0.5 req/s, 64 outputs) against `ppserve serve`. Carry .gpu (Ray) and .whl (sgl-flash-mla).
set -uo pipefail
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/raysite.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
PP=1 timeout 300 bash docs/bench/scripts/serve_bench.sh "$OUT" auto --request-rates 0.5 \
    --num-prompts 10 --input-lens 16384 32768 --output-lens 64 > /dev/null 2>&1
tail -25 "$OUT/bench_serve_auto.log"

#!/usr/bin/env bash
# Issue 12 on one H200: the paged decode kernel and decode-graph tests, then the decode bench
# (graphs, eager paged, graphs + run-ahead). Run from the repo root on the GPU host with Ray's
# archive carried in .gpu/ (docs/PERFORMANCE.md says how); logs and JSON go to $OUT.
set -uo pipefail
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/raysite.tar.xz && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.log"
python3 -m pytest -q -m gpu tests/gpu/test_paged_decode.py tests/gpu/test_decode_graphs.py \
    -p no:cacheprovider -x 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
bench="python3 -m app.bench.load --pp 1 --device cuda --parts decode --decode-tokens 48 --reps 2"
$bench --out "$OUT/decode_graphs.json" 2>&1 | grep -v "^(raylet)" | tail -15 | tee "$OUT/decode.log"
${EXTRA:-true}

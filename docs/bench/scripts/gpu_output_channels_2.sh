#!/usr/bin/env bash
# One H200, second call of issue 25: app/bench/output_channels.py with its controls (the copy
# engine busy with nobody waiting; the copy path's parts), then the engine's PP=1 decode with
# --output-channel nccl (a local scatter at PP=1) and host (each step's token through the
# coordinator). Same setup as gpu_output_channels.sh.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp COMMIT "$OUT/commit.txt"
timeout 180 python3 -m app.bench.output_channels --out "$OUT/output_channels.json" \
    > "$OUT/output_channels.log" 2>&1
tail -9 "$OUT/output_channels.log" | cut -c1-400
for ch in nccl host; do
    timeout 140 python3 -m app.bench.load --pp 1 --parts decode --layers 4 --reps 1 \
        --decode-modes auto --decode-concurrency 64 --decode-tokens 128 --run-ahead \
        --output-channel $ch --out "$OUT/load_pp1_decode_$ch.json" > "$OUT/load_$ch.log" 2>&1
    tail -4 "$OUT/load_$ch.log"
done

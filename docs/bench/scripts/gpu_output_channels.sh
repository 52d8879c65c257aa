#!/usr/bin/env bash
# One H200 (issue 25): the GPU tests (tests/gpu, the copy channel's two processes on one GPU
# among them), then the output-channel measurements (app/bench/output_channels.py).
# Run from a copy of the tree with Ray unpacked in /tmp/site and sgl-flash-mla's wheel in whl/:
#   mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/raysite.tar.xz && cd .wt/channel &&
#   bash docs/bench/scripts/gpu_output_channels.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp COMMIT "$OUT/commit.txt"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_copy_channel.py -p no:cacheprovider \
    2>&1 | tail -40 > "$OUT/gpu_test_copy_channel.log"
tail -3 "$OUT/gpu_test_copy_channel.log"
timeout 180 python3 -m app.bench.output_channels --out "$OUT/output_channels.json" \
    > "$OUT/output_channels.log" 2>&1
tail -12 "$OUT/output_channels.log"
timeout 200 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
    --ignore tests/gpu/test_copy_channel.py 2>&1 | tail -15 > "$OUT/gpu_tests.log"
tail -4 "$OUT/gpu_tests.log"

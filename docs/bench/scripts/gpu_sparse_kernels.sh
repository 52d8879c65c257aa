#!/usr/bin/env bash
# One H200: FlashMLA sparse prefill / FP8 sparse decode tests against the torch reference and
# their timings alone. Carry .gpu (Ray, for the bench's environment record) and .whl.
set -uo pipefail
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/raysite.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/gpu/test_flash_mla_sparse.py -p no:cacheprovider -x \
    2>&1 | tail -30 | tee "$OUT/gpu_sparse_tests.log"
timeout 200 python3 -m app.bench.sparse_mla --out "$OUT/sparse_mla.json" 2>&1 | tail -20

#!/usr/bin/env bash
# Session 13, call 6 (one H200, Ray carried): V4-Flash bf16 TTFT at 64K-256K through the engine
# (the FP8-against-bf16 margin at 256K). Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
timeout 170 python3 -m app.cli bench suite --only ttft-v4-flash --device cuda --timeout 165 --out "$R/suite" > "$R/ttft-v4-flash.log" 2>&1
echo "rc $?" | tee -a "$R/ttft-v4-flash.log"; grep TTFT "$R/ttft-v4-flash.log"

#!/usr/bin/env bash
# Session 13, call 4 (one H200, Ray carried): the batched-vs-alone engine test on V4 / V3.2 after
# rope_tail, the swept _project tiles and session 12's V4 FP8 chunk / decode split (b15ff42),
# then the V4-Flash FP8 512K / 1M TTFT row. Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -3 "$R/$name.log"; }
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
LIMIT=400 step batched python3 -m pytest -rA -s -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py
LIMIT=180 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 --device cuda --timeout 175 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

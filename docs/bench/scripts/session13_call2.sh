#!/usr/bin/env bash
# Session 13, call 2 (one H200, Ray carried): the rope_tail GPU test after its tolerance mend,
# the tile sweeps of rope_tail and the hyper-connections' _project, and V4-Flash FP8 TTFT at
# 64K / 128K / 256K through the engine with rope_tail on Triton. Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -4 "$R/$name.log"; }
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
LIMIT=100 step rope_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider tests/gpu/test_triton_rope.py
LIMIT=150 step sweep python3 docs/bench/scripts/session13_sweep.py "$R/sweep.jsonl"
LIMIT=230 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 220 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

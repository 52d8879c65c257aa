#!/usr/bin/env bash
# Session 12, call 4 (one H200, Ray carried): which half of "--quantization fp8 --kv-cache-dtype
# fp8" makes V4's batched requests part from their lone runs (call 3: bf16 alike to 1e-7 - 0.04
# nats, FP8 parting at the first steps): the same test on a copy with the two halves apart.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -5 "$R/$name.log"; }
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
sed -e 's/^FORMATS = .*/FORMATS = {"w8a8": {"quantization": "fp8"}, "kv8": {"kv_cache_dtype": "fp8"}}/' \
    -e 's/^BOUNDS = .*/BOUNDS = {"w8a8": Bounds(1.5, 0.2, 0.75), "kv8": Bounds(1.5, 0.2, 0.75)}/' \
    tests/gpu/test_batched_vs_alone_cuda.py > tests/gpu/test_fp8_halves_tmp.py
LIMIT=400 step halves python3 -m pytest -rA -m gpu -p no:cacheprovider -k v4 tests/gpu/test_fp8_halves_tmp.py
grep -A40 "against alone" "$R/halves.log" | grep -v INFO > "$R/tables.txt"
tar czf "$OUT/results.tgz" -C "$OUT" r

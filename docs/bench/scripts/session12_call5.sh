#!/usr/bin/env bash
# Session 12, call 5 (one H200, Ray carried). (1) The V4 batched-vs-alone test under FP8 KV with
# every forward on FlashMLA's FP8 kernel (--fp8-prefill-attention flash-mla): call 4 found the
# FP8 KV half parting batched requests from their lone runs; alone, prompts' chunks run the
# bf16 prefill kernel over dequantized keys, batched with decode rows the FP8 decode kernel.
# (2) DeepGEMM rebuilt; where its JIT kernels' first call segfaults (gdb, if the host has it).
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -5 "$R/$name.log"; }
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
sed -e 's/^FORMATS = .*/FORMATS = {"kv8inplace": {"kv_cache_dtype": "fp8", "fp8_prefill_attention": "flash-mla"}}/' \
    -e 's/^BOUNDS = .*/BOUNDS = {"kv8inplace": Bounds(1.5, 0.2, 0.75)}/' \
    tests/gpu/test_batched_vs_alone_cuda.py > tests/gpu/test_fp8_inplace_tmp.py
LIMIT=200 step inplace python3 -m pytest -rA -m gpu -p no:cacheprovider -k v4 tests/gpu/test_fp8_inplace_tmp.py
grep -A40 "against alone" "$R/inplace.log" | grep -v INFO > "$R/tables.txt"
LIMIT=150 step dg_build bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
. /tmp/dg/env.sh
command -v gdb > "$R/gdb.txt" 2>&1
if command -v gdb >/dev/null; then
  LIMIT=90 step dg_gdb gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 docs/bench/scripts/session12_dg_probe.py
fi
LIMIT=60 DG_JIT_USE_NVRTC=1 step dg_nvrtc python3 -X faulthandler docs/bench/scripts/session12_dg_probe.py
tar czf "$OUT/results.tgz" -C "$OUT" r

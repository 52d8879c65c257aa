#!/usr/bin/env bash
# What session 12 left for the GPU host (not yet run): the per-row kernel tests (FlashMLA's dense
# and FP8 decode batched against alone), the batched-vs-alone engine test after V4's mixed FP8
# forwards split (b15ff42), and DeepGEMM's crash with a native backtrace. One H200, Ray carried
# (.gpu), .whl, .tfw (the trimmed transformers 5.24 of session 12), .gpu-deepgemm; results
# under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -8 "$R/$name.log"; }
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
LIMIT=120 step kernels python3 -m pytest -rA -m gpu -p no:cacheprovider -k "alone or batch" \
  tests/gpu/test_mla_moe_kernels.py tests/gpu/test_flash_mla_v4.py
LIMIT=420 step batched python3 -m pytest -rA -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py
if [ -d .gpu-deepgemm ]; then
  gcc -shared -fPIC -O0 -o /tmp/segv.so docs/bench/scripts/segv_backtrace.c
  DG_CXX=g++ LIMIT=150 step dg_build bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
  . /tmp/dg/env.sh
  LD_PRELOAD=/tmp/segv.so LIMIT=60 step dg_probe python3 docs/bench/scripts/session12_dg_probe.py
fi
tar czf "$OUT/results.tgz" -C "$OUT" r

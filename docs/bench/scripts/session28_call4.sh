#!/usr/bin/env bash
# Session 28, call 4 (one GPU, whichever comes; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw,
# .commit; not run: the device budget was out): what session 28 left unchecked on a GPU, in
# order: V4's batched, staggered requests against alone and eager with FP8 weights (the
# side-by-side gate/up's engine check), V4's decode graph tests, the revised hyper-connection
# merge test, and the one-row / 512-row FP8 decode step with plain launches (--no-pdl: each
# kernel's own time). On an H200, then the rows of record (session28_call2.sh, a second call).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-580}
LIMIT=200 step batched_fp8 python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and fp8"
LIMIT=150 step v4_graphs python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_v4_decode_graphs.py
LIMIT=60 step merge python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_triton_hyper.py -k merge
left=$((D - SECONDS))
[ $left -gt 30 ] && LIMIT=$((left - 5)) step v4_decode_nopdl python3 -m app.bench.v4_decode \
  --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,512 --no-pdl \
  --out "$R/v4_decode_nopdl.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

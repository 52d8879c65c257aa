#!/usr/bin/env bash
# Session 13, call 1 (one H200, Ray carried): the rope_tail kernel's GPU tests and the V4
# tests it touches, the per-row kernel tests session 12 left, and A/B benches at the same commit
# with rope_tail on its torch form (pinned by with_kernels.py) and on Triton: the 256K FP8
# chunk's breakdown, the V4 decode stage in FP8. Results under $OUT/r.
set -u
. docs/bench/scripts/host_env.sh
W=docs/bench/scripts/with_kernels.py
LIMIT=150 step rope_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider tests/gpu/test_triton_rope.py
LIMIT=120 step kernels python3 -m pytest -q -rA -m gpu -p no:cacheprovider -k "alone or batch" \
  tests/gpu/test_mla_moe_kernels.py tests/gpu/test_flash_mla_v4.py
for k in triton torch; do
  LIMIT=120 step breakdown_$k python3 $W rope_tail=$k -m app.bench.deepseek_breakdown --linear auto \
    --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8_$k.json"
  LIMIT=100 step v4_decode_$k python3 $W rope_tail=$k -m app.bench.v4_decode --rows 1,64,512 --context 512 \
    --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8_$k.json"
done
LIMIT=200 step v4_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_deepseek_v4_cuda.py \
  tests/gpu/test_deepseek_v4_decode_graphs.py tests/gpu/test_triton_hyper.py
tar czf "$OUT/results.tgz" -C "$OUT" r

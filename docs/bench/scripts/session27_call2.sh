#!/usr/bin/env bash
# Session 27, call 2 (one GPU; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the
# block-scaled K loops loading the next K tile's scales a step ahead (triton_gemm.SCALES_AHEAD,
# on in the tree) against a copy in /tmp/off with it off: the FP8 kernels' GPU tests, the grouped
# gate/up GEMM fused and unfused at 1-8192 tokens (app.bench.fp8 --moe-swiglu), and the V4-Flash
# FP8 decode step in graphs at 1 and 512 rows, context 512 (app.bench.v4_decode), interleaved.
set -u
. docs/bench/scripts/host_env.sh
rm -rf /tmp/off && mkdir -p /tmp/off && cp -r app stages docs /tmp/off/
sed -i 's/^    SCALES_AHEAD = tl.constexpr(True)$/    SCALES_AHEAD = tl.constexpr(False)/' \
  /tmp/off/stages/kernels/triton_gemm.py
grep -c "^    SCALES_AHEAD = tl.constexpr(False)$" /tmp/off/stages/kernels/triton_gemm.py
off() { bash -c "cd /tmp/off && PYTHONPATH=/tmp/site:/tmp/off $*"; }
LIMIT=150 step fp8_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_fp8_kernels.py tests/gpu/test_triton_gemm.py
S="python3 -m app.bench.fp8 --moe-swiglu"
LIMIT=90 step swiglu_on $S --out "$R/swiglu_on.json"
LIMIT=90 step swiglu_off off "$S --out $R/swiglu_off.json"
D="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,512"
LIMIT=170 step decode_on_1 $D --out "$R/decode_on_1.json"
LIMIT=110 step decode_off_1 off "$D --out $R/decode_off_1.json"
[ $SECONDS -lt $((${DEADLINE:-570} - 80)) ] && LIMIT=80 step decode_on_2 $D --out "$R/decode_on_2.json"
grep -h "step\|ms" $R/decode_*.log | grep -i "rows\|step" | head -20
tar czf "$OUT/results.tgz" -C "$OUT" r

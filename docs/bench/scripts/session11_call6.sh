#!/usr/bin/env bash
# Session 11, the fused FP8 MoE activation (silu * up, V4's clamp, the 1 x 128 quantizer in one
# kernel) on one H200 (Ray carried): its GPU tests and the FP8 kernels', the 256K chunk's FP8
# breakdown, the V4-Flash FP8 TTFT row and the V4 decode stage bench in FP8. Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; }
step gpu_tests python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fp8_kernels.py
step breakdown_fp8 python -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
LIMIT=200 step ttft-v4-flash-fp8 python -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 190 --out "$R/suite"
step v4_decode_fp8 python -m app.bench.v4_decode --rows 1,64,512 --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

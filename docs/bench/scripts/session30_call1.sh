#!/usr/bin/env bash
# Next session, call 1 (one H200: the bf16 8-layer stage needs more than an H100's 80 GB; carry
# .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit; written in session 29, not run): the GPU test of
# the SwiGLU quantizer's launch (8 rows a program, 4 warps), then the V4-Flash rows of record
# still missing on an H200: the decode step in graphs at 1-512 rows in bf16, the TTFT rows in
# bf16 and FP8 (the FP8 JSON of 7193b8d did not come back; FP8 against bf16 at 256K), the
# engine's 512-row decode rows, the 256K chunk with plain launches (each kernel's own time).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-570}
LIMIT=90 step fp8_kernels python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_fp8_kernels.py -k "swiglu or experts"
LIMIT=60 step v4_decode_bf16 python3 -m app.bench.v4_decode --context 512 \
  --rows 1,16,64,256,512 --out "$R/v4_decode_bf16.json"
LIMIT=170 step ttft-v4-flash python3 -m app.cli bench suite --only ttft-v4-flash,ttft-v4-flash-fp8 \
  --device cuda --timeout 115 --out "$R/suite"
left=$((D - SECONDS))
[ $left -gt 80 ] && LIMIT=75 step decode-v4-flash-512 python3 -m app.cli bench suite \
  --only decode-v4-flash-512 --device cuda --timeout 70 --out "$R/suite"
left=$((D - SECONDS))
[ $left -gt 80 ] && LIMIT=75 step decode-v4-flash-512-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-512-fp8 --device cuda --timeout 70 --out "$R/suite"
left=$((D - SECONDS))
[ $left -gt 70 ] && LIMIT=65 step breakdown_fp8_nopdl python3 -m app.bench.deepseek_breakdown \
  --linear auto --quantization fp8 --kv-cache-dtype fp8 --no-pdl \
  --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8_nopdl.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"  # one file back (a call returns a few files only)

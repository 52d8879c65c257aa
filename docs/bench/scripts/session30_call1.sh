#!/usr/bin/env bash
# Session 30, call 1 (one H200: the bf16 8-layer stage needs more than an H100's 80 GB; carry
# .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the GPU tests of v4_pick_slots and of the
# SwiGLU quantizer's launch (8 rows a program, 4 warps); the FP8 decode step at this tree (the
# picks' slots in one kernel, the sinks unpadded); the V4-Flash rows of record still missing on
# an H200: the bf16 decode step in graphs at 1-512 rows, the TTFT rows in bf16 and FP8 (FP8
# against bf16 at 256K); V4's staggered, batched FP8 requests against alone (the picks' new
# kernel is on their decode path); the 256K chunk with plain launches if time is left.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-575}
LIMIT=90 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_v4_paged_index_cuda.py tests/gpu/test_fp8_kernels.py -k "pick_slots or swiglu or experts"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,512 --out "$R/v4_decode_fp8.json"
LIMIT=60 step v4_decode_bf16 python3 -m app.bench.v4_decode --context 512 \
  --rows 1,16,64,256,512 --out "$R/v4_decode_bf16.json"
LIMIT=170 step ttft-v4-flash python3 -m app.cli bench suite --only ttft-v4-flash,ttft-v4-flash-fp8 \
  --device cuda --timeout 115 --out "$R/suite"
left=$((D - SECONDS))
[ $left -gt 100 ] && LIMIT=$((left - 20 < 150 ? left - 20 : 150)) step batched_fp8 python3 -m pytest \
  -rA -q -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and fp8"
left=$((D - SECONDS))
[ $left -gt 70 ] && LIMIT=65 step breakdown_fp8_nopdl python3 -m app.bench.deepseek_breakdown \
  --linear auto --quantization fp8 --kv-cache-dtype fp8 --no-pdl \
  --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8_nopdl.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"  # one file back (a call returns a few files only)

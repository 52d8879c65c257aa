#!/usr/bin/env bash
# Session 28, call 3 (one GPU; carry as call 1): the fused gate/up with gate and up side by side
# as the only path (SWIGLU_LAUNCH), checked: its GPU test and the hyper-connections' (the comb
# summed as [S, T, N * N]); V4's batched, staggered requests against alone and eager in bf16
# and FP8; then issue 34's FP8 decode rows (1, 16, 64, 256, 512) in graphs; with --no-pdl the
# 256K last chunk's groups; V4's decode graph tests (graphed equals eager equals the general
# path); the decode step's kernels with --no-pdl. Steps in that order, as the time allows.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-580}
LIMIT=100 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_fp8_kernels.py tests/gpu/test_triton_hyper.py -k "fused_gate_up or hyper"
left=$((D - SECONDS))
LIMIT=$((left > 230 ? 170 : left - 60)) step batched python3 -m pytest -rA -q -m gpu \
  -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and (bf16 or fp8)"
left=$((D - SECONDS))
[ $left -gt 30 ] && LIMIT=$((left > 75 ? 50 : left - 5)) step v4_decode python3 -m \
  app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 \
  --rows 1,16,64,256,512 --out "$R/v4_decode.json"
left=$((D - SECONDS))
[ $left -gt 30 ] && LIMIT=$((left > 75 ? 50 : left - 5)) step breakdown_nopdl python3 -m \
  app.bench.deepseek_breakdown --linear auto --quantization fp8 --kv-cache-dtype fp8 --no-pdl \
  --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_nopdl.json"
left=$((D - SECONDS))
[ $left -gt 60 ] && LIMIT=$((left > 160 ? 120 : left - 5)) step v4_graphs python3 -m pytest -rA \
  -q -m gpu -p no:cacheprovider tests/gpu/test_deepseek_v4_decode_graphs.py
left=$((D - SECONDS))
[ $left -gt 25 ] && LIMIT=$((left - 5)) step v4_decode_nopdl python3 -m app.bench.v4_decode \
  --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,512 --no-pdl \
  --out "$R/v4_decode_nopdl.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 28, call 3 (one GPU; carry as call 1): the fused gate/up with gate and up side by side
# as the only path (SWIGLU_LAUNCH), checked: its GPU test, V4's decode graphs (graphed equals
# eager equals the general path; the engine's tokens equal --enforce-eager's) and V4's batched,
# staggered requests against alone and eager in bf16 and FP8; the hyper-connections' GPU tests
# (the comb summed as [S, T, N * N]); then issue 34's FP8 decode rows (1, 16, 64, 256, 512) in
# graphs, and with --no-pdl the 256K last chunk's groups and the decode step's kernels.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT=150 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_fp8_kernels.py tests/gpu/test_triton_hyper.py -k "fused_gate_up or hyper"
LIMIT=150 step v4_graphs python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepseek_v4_decode_graphs.py
left=$((${DEADLINE:-580} - SECONDS))
LIMIT=$((left > 250 ? 170 : left - 80)) step batched python3 -m pytest -rA -q -m gpu \
  -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and (bf16 or fp8)"
left=$((${DEADLINE:-580} - SECONDS))
[ $left -gt 50 ] && LIMIT=$((left > 100 ? 60 : left - 5)) step v4_decode python3 -m app.bench.v4_decode \
  --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16,64,256,512 --out "$R/v4_decode.json"
left=$((${DEADLINE:-580} - SECONDS))
[ $left -gt 40 ] && LIMIT=$((left > 80 ? 60 : left - 5)) step breakdown_nopdl python3 -m \
  app.bench.deepseek_breakdown --linear auto --quantization fp8 --kv-cache-dtype fp8 --no-pdl \
  --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_nopdl.json"
left=$((${DEADLINE:-580} - SECONDS))
[ $left -gt 30 ] && LIMIT=$((left - 5)) step v4_decode_nopdl python3 -m app.bench.v4_decode \
  --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,512 --no-pdl \
  --out "$R/v4_decode_nopdl.json"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

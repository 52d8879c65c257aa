#!/usr/bin/env bash
# Session 34, one H200 or H100 (carry .gpu, .whl, .commit, .tfw): the W8A8 decode linear
# (stages/kernels/triton_fp8_decode_linear.py, auto's fp8_linear up to 32 rows): its GPU tests
# (rows' bits alone and batched, the Triton GEMM's bits; the registry backends' reference
# tests), its shapes against cuBLASLt by time and bits (app.bench.fp8_decode_linear), the FP8
# V4-Flash decode step in graphs at 1 and 16 rows against --fp8-linear scaled-mm (two rounds,
# interleaved), then V4's staggered, batched W8A8 and FP8 requests against each alone and the
# V4 decode graph tests.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
run kernel_tests 100 python3 -m pytest -q tests/gpu/test_fp8_decode_linear_cuda.py \
  tests/gpu/test_fp8_kernels.py -k "decode or test_fp8_decode"
run shapes 70 python3 -m app.bench.fp8_decode_linear --out "$R/decode_linear.json"
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
for round in 1 2; do
  run "decode_new_$round" 75 $DEC --out "$R/decode_new_$round.json"
  run "decode_cublas_$round" 75 $DEC --fp8-linear scaled-mm --out "$R/decode_cublas_$round.json"
done
run batched 170 python3 -m pytest -q -x tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and (fp8 or w8a8)" -rA
run graphs 90 python3 -m pytest -q -x tests/gpu/test_deepseek_v4_decode_graphs.py
grep -h "ms_per_step\|ms a step\|passed\|failed\|Error" $R/*.log | cut -c1-300 | head -40
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

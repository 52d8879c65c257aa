#!/usr/bin/env bash
# Session 34, one H200 or H100 (carry .gpu, .whl, .commit, .tfw): a decode step's FP8 weights
# with their rows as the MMA's wide side: the W8A8 linears (triton_fp8_decode_linear, auto's
# fp8_linear up to 32 rows) and the routed experts (triton_moe_fp8_decode, below 64 tokens).
# Their GPU tests (rows' bits alone and batched; the registry backends' reference tests); the
# FP8 V4-Flash decode step in graphs at 1 and 16 rows: the tree, the experts on the 64-row
# tiles, the same with cuBLASLt's linears (the tree before), the experts' 128-wide gate/up
# groups (two rounds); V4's staggered, batched W8A8 and FP8 requests against each alone; the
# linears' shapes against cuBLASLt by time and bits; the V4 decode graph tests.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
run kernel_tests 110 python3 -m pytest -q tests/gpu/test_fp8_decode_linear_cuda.py \
  tests/gpu/test_fp8_moe_decode_cuda.py tests/gpu/test_fp8_kernels.py -k "decode or moe"
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
for round in 1 2; do
  run "decode_tree_$round" 50 $DEC --out "$R/decode_tree_$round.json"
  run "decode_before_$round" 50 $DEC --fp8-linear scaled-mm --moe-decode tiles \
    --out "$R/decode_before_$round.json"
  run "decode_tiles_$round" 50 $DEC --moe-decode tiles --out "$R/decode_tiles_$round.json"
  run "decode_fused_$round" 50 $DEC --moe-decode swapped-fused --out "$R/decode_fused_$round.json"
done
run batched 200 python3 -m pytest -q -x tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and (fp8 or w8a8)" -rA
run shapes 60 python3 -m app.bench.fp8_decode_linear --out "$R/decode_linear.json"
run graphs 80 python3 -m pytest -q -x tests/gpu/test_deepseek_v4_decode_graphs.py
grep -h "ms_per_step\|passed\|failed\|Error" $R/*.log | cut -c1-240 | head -40
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

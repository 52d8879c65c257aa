#!/usr/bin/env bash
# Session 21, call 1 (one H200; carry .gpu .whl .tfw .commit): session 20's two dispatch changes
# (the MoE's fused SwiGLU epilogue below UNFUSED_SWIGLU_FROM tokens only; the rule's one-program
# top-k up to RULE_KERNEL_MAX_LINES lines only), their GPU tests and A/Bs at the crossover, then
# issue 34's and 35's H200 rows: the V4 decode stage in graphs (FP8, 1/64/512 rows), the last
# 8K chunk of 256K by groups (FP8 and bf16), the FP8 TTFT row and the FP8 engine decode at 512.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
F=tests/gpu/test_fp8_kernels.py
LIMIT=100 step gpu_tests $GPU_PYTEST -x $F::test_fp8_experts_match_reference \
  $F::test_fused_gate_up_swiglu_equals_the_unfused_path tests/gpu/test_rule_topk_cuda.py \
  tests/gpu/test_indexer_kernel.py::test_tie_rule_on_cuda_is_a_stable_sort
LIMIT=45 step moe_swiglu python3 -m app.bench.fp8 --moe-swiglu --out "$R/moe_swiglu.json"
LIMIT=60 step rule_topk python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x1:2304,512x1:2304,1x1024:32768,1x2048:65536,1x8192:262144 \
  --out "$R/indexer_select.json"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
for q in fp8 bf16; do
  [ $q = fp8 ] && FLAGS="--quantization fp8 --kv-cache-dtype fp8" || FLAGS=""
  LIMIT=30 step breakdown_$q python3 -m app.bench.deepseek_breakdown --linear auto $FLAGS \
    --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_$q.json"
done
LIMIT=130 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 125 --out "$R/suite"
left=$((575 - SECONDS)); LIMIT=$((left < 90 ? left : 90))
step decode-v4-flash-512-fp8 python3 -m app.cli bench suite --only decode-v4-flash-512-fp8 \
  --device cuda --timeout $((LIMIT - 5)) --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

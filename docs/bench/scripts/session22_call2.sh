#!/usr/bin/env bash
# Session 22, call 2 (one H100 or H200; carry .gpu .whl .tfw .commit), after call 1 set the
# defaults (the MoE's prefill tiles through TMA descriptors, the rule's top-k kernel up to 512
# lines, the Gluon kernels removed): their GPU tests, the last 8K chunk of 256K by groups, then
# issue 34's and 35's FP8 rows through the engine (TTFT 64K-256K, decode at 512 rows).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
F=tests/gpu/test_fp8_kernels.py
LIMIT=100 step gpu_tests $GPU_PYTEST $F::test_fp8_experts_match_reference \
  $F::test_grouped_gemm_through_tma_equals_the_pointer_loads tests/gpu/test_rule_topk_cuda.py \
  tests/gpu/test_indexer_kernel.py::test_tie_rule_on_cuda_is_a_stable_sort
LIMIT=30 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 \
  --out "$R/breakdown_fp8.json"
LIMIT=130 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 125 --out "$R/suite"
LIMIT=90 step decode-v4-flash-512-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-512-fp8 --device cuda --timeout 85 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r

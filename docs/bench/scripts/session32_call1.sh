#!/usr/bin/env bash
# Session 32, call 1 (one H100 or H200; carry .gpu, .whl, .commit, .gpu-deepgemm: .tfw left out
# for the 64 MiB, nothing here imports transformers). DeepGEMM built (skipped where a warm
# machine has it), then in order while time lasts:
# - the deepgemm indexer backend's GPU tests (stages/kernels/deepgemm_indexer.py) and its bench
#   beside the Triton kernels (V4's CSA at the 256K last chunk, four rows of 2K tokens at 64K);
# - V4-Flash's FP8 TTFT rows with DeepGEMM in the MoE and the indexer (auto's first where
#   deep_gemm imports; the routing kernels writing m_indices and the experts' warm-up run on a
#   GPU for the first time);
# - on an H200: 512K and 1,040,384 tokens, then the bf16 decode steps in graphs (the 8-layer
#   bf16 stage does not fit an H100); on an H100: the 256K last chunk by groups and the
#   deepgemm MoE's GPU tests.
set -u
. docs/bench/scripts/host_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
DEADLINE=${DEADLINE:-575}
use_deepgemm 110
run dg_indexer_tests 70 /tmp/with_dg python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepgemm_indexer_cuda.py
run indexer_dg 90 /tmp/with_dg python3 -m app.bench.indexer_select --deepgemm --rate 4 \
  --topk 512 --cases 1x8192:262144,4x2048:65536 --out "$R/indexer_dg.json"
run ttft_fp8_deepgemm 150 /tmp/with_dg python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 140 --out "$R/suite_fp8"
if [[ "$GPU" == *H200* ]]; then
  run ttft_1m_fp8_deepgemm 200 /tmp/with_dg python3 -m app.cli bench suite --only \
    ttft-v4-flash-1m-fp8 --device cuda --timeout 190 --out "$R/suite_1m_fp8"
  run v4_decode_bf16 70 python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 \
    --out "$R/v4_decode_bf16.json"
else
  CASE=deepseek-v4-flash:8:262144:8192:512:512
  run breakdown_deepgemm 75 /tmp/with_dg python3 -m app.bench.deepseek_breakdown --linear auto \
    --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --out "$R/breakdown_deepgemm.json"
  run dg_moe_tests 70 /tmp/with_dg python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
    tests/gpu/test_deepgemm_moe_cuda.py
fi
grep -h "^| \|^{" $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

#!/usr/bin/env bash
# Session 32, call 1 (one H100 or H200; carry .gpu, .whl, .commit, .gpu-deepgemm): DeepGEMM
# built (skipped where a warm machine has it), then DeepGEMM's fp8_mqa_logits beside our
# indexer chunk kernel (app.bench.indexer_deepgemm: V4's CSA at the 256K and 128K last chunks,
# four rows of 2K tokens at 64K), the deepgemm MoE's GPU tests (the routing kernels writing
# m_indices, first run on a GPU), and the FP8 TTFT rows with DeepGEMM (the experts' warm-up
# at startup, first run on a GPU), the 256K last chunk by groups with DeepGEMM in the MoE and
# the indexer (auto's first where deep_gemm imports).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-575}
test -f /tmp/dg/env.sh || LIMIT=110 step build_dg env DG_CXX=/usr/bin/g++ \
  bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
printf '#!/usr/bin/env bash\n. /tmp/dg/env.sh && export DG_JIT_DEBUG=0 DG_JIT_PRINT_COMPILER_COMMAND=0 && exec "$@"\n' > /tmp/with_dg
chmod +x /tmp/with_dg
# run NAME SECONDS CMD...: CMD if SECONDS are left before the deadline
run() { local name=$1 need=$2; shift 2; local left=$((D - SECONDS))
  if [ $left -gt $need ]; then LIMIT=$((left - 5 < need ? left - 5 : need)) step "$name" "$@"; else echo "skipped $name ($left s left)"; fi; }
run indexer_dg 150 /tmp/with_dg python3 -m app.bench.indexer_select --deepgemm --rate 4 \
  --topk 512 --cases 1x8192:262144,1x8192:131072,4x2048:65536 --out "$R/indexer_dg.json"
run dg_indexer_tests 80 /tmp/with_dg python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepgemm_indexer_cuda.py
run dg_moe_tests 90 /tmp/with_dg python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepgemm_moe_cuda.py
CASE=deepseek-v4-flash:8:262144:8192:512:512
run breakdown_deepgemm 75 /tmp/with_dg python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --out "$R/breakdown_deepgemm.json"
run ttft_fp8_deepgemm 150 /tmp/with_dg python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 140 --out "$R/suite_fp8"
grep -h "^| \|^{" $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

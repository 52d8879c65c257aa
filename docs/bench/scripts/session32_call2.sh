#!/usr/bin/env bash
# Session 32, call 2 (one H100 or H200; carry .gpu, .whl, .commit, .gpu-deepgemm): call 1's FP8
# TTFT suite row timed out at 140 s with no output, so the engine bench runs here directly
# (its log kept) with DeepGEMM in the MoE and the Triton indexer (auto's order again): the
# experts' warm-up and the routing kernels writing m_indices through the engine; then the
# deepgemm indexer backend's GPU tests at the Triton kernels' tolerance against the reference.
set -u
. docs/bench/scripts/host_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
D=${DEADLINE:-575}
test -f /tmp/dg/env.sh || LIMIT=110 step build_dg env DG_CXX=/usr/bin/g++ \
  bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
printf '#!/usr/bin/env bash\n. /tmp/dg/env.sh && export DG_JIT_DEBUG=0 DG_JIT_PRINT_COMPILER_COMMAND=0 && exec "$@"\n' > /tmp/with_dg
chmod +x /tmp/with_dg
run() { local name=$1 need=$2; shift 2; local left=$((D - SECONDS))
  if [ $left -gt $need ]; then LIMIT=$((left - 5 < need ? left - 5 : need)) step "$name" "$@"; else echo "skipped $name ($left s left)"; fi; }
run ttft_fp8_deepgemm 330 /tmp/with_dg python3 -m app.bench.engine --model-shape deepseek-v4-flash \
  --pp 1 --linear auto --runs 65536:8192,131072:8192,262144:8192 --modes auto --reps 1 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/ttft_fp8_deepgemm.json"
grep -n "warm\|took\|TTFT\|ttft\|Error\|error" "$R/ttft_fp8_deepgemm.log" | head -40
run dg_indexer_tests 40 /tmp/with_dg python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepgemm_indexer_cuda.py
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

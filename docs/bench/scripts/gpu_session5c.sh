#!/usr/bin/env bash
# One H200, session 5, third call (after the merges of fp8idx, fp8ckpt and the mended Triton
# hyper-connections): their GPU tests (hyper-connections and V4 on CUDA; the FP8 indexer keys,
# V3.2 on CUDA, FP8 decode graphs == eager, the FP8 kernels: gpu_fp8_indexer.sh), a real FP8
# checkpoint through `ppserve serve` on CUDA with the official openai client
# (tests/gpu/test_serve_fp8_checkpoint.py), and the V4-Flash shape's breakdown under the stand-in
# on the mended kernels. Carry .gpu (Ray) and .wt/lead (whl, whl_openai).
set -uo pipefail
NAME=session5c BUDGET=${BUDGET:-560}
. docs/bench/scripts/session_steps.sh

step gpu tests: hyper-connections, V4 on CUDA
timeout "$(left 60)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/gpu/test_triton_hyper.py tests/gpu/test_deepseek_v4_cuda.py 2>&1 | tail -30 \
    > "$RES/gpu_tests_hyper.log"; tail -6 "$RES/gpu_tests_hyper.log" | tee -a "$LOG"
pack

step gpu tests: FP8 indexer keys and the FP8 kernels
OUT=$RES BUDGET=150 timeout 160 bash docs/bench/scripts/gpu_fp8_indexer.sh 2>&1 \
    | grep "===\|exit\|passed\|failed" | tee -a "$LOG"
pack

step an FP8 checkpoint through ppserve serve on CUDA
OUT=$RES timeout "$(left 250)" python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfEs \
    tests/gpu/test_serve_fp8_checkpoint.py > "$RES/gpu_serve_fp8_checkpoint.log" 2>&1
echo "pytest rc $?" | tee -a "$LOG"; tail -8 "$RES/gpu_serve_fp8_checkpoint.log" | tee -a "$LOG"
pack

step V4-Flash shape under the stand-in, mended hyper-connections
timeout "$(left 70)" python3 -m app.bench.deepseek_breakdown --standin \
    --cases deepseek-v4-flash:8:131072:8192:512:512 \
    --out "$RES/deepseek_v4_standin_hc2.json" 2>&1 | tail -c 300 | tee -a "$LOG"
pack
step done

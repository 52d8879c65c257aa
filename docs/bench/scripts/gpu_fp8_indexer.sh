#!/usr/bin/env bash
# One H200: DeepSeek-V3.2's FP8 indexer keys (branch fp8idx) -- the GPU tests that touch them: the
# Triton indexer kernels on bf16 and FP8 keys and the keys' quantize-on-write
# (tests/gpu/test_indexer_kernel.py), the V3.2 stage on CUDA incl. an FP8 cache whose indexer
# runs on Triton (tests/gpu/test_dsa_cuda.py), the FP8 decode graphs == eager (the FP8 keys
# written and scored inside the graph; tests/gpu/test_deepseek_decode_graphs.py, its tests
# without Ray), and the FP8 kernels and FP8 V3.2 stage (tests/gpu/test_fp8_kernels.py). No Ray.
# 150 s in all (BUDGET), each file cut to its cap or what is left.
# Run from the tree's root (main, or a copy of the branch under .wt/fp8idx); the sgl-flash-mla
# wheel is taken from .wt/lead/whl or ../lead/whl (WHL to override).
set -uo pipefail
WHL=${WHL:-$(for d in .wt/lead/whl ../lead/whl; do [ -d "$d" ] && echo "$d" && break; done)}
[ -n "$WHL" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$WHL"/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-150}
LOG="$OUT/gpu_fp8_indexer.log"
left() {  # seconds for a step: its cap, or what is left of BUDGET
    local l=$((BUDGET - SECONDS)); [ "$l" -lt "$1" ] && echo $((l > 5 ? l : 5)) || echo "$1"
}
run() {  # cap in seconds, then pytest's arguments
    local cap=$1; shift
    echo "=== [$SECONDS s] $*" | tee -a "$LOG"
    timeout "$(left "$cap")" python3 -m pytest -q -rfEs -m gpu -p no:cacheprovider "$@" 2>&1 \
        | tail -30 | tee -a "$LOG"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
run 45 tests/gpu/test_indexer_kernel.py
run 30 tests/gpu/test_dsa_cuda.py
run 45 tests/gpu/test_deepseek_decode_graphs.py -k "graphed_decode_equals_eager"
run 60 tests/gpu/test_fp8_kernels.py
echo "=== [$SECONDS s] done" | tee -a "$LOG"

#!/usr/bin/env bash
# One H200: FlashMLA + Triton MoE kernel tests, the decode-graph tests, the Llama-8B decode bench
# (graphs + run-ahead) and a DeepSeek-V2-Lite PP=1 prefill bench. Carry .gpu (Ray) and .whl
# (sgl-flash-mla 1.0.0, installed --no-deps). Logs and JSON go to $OUT.
set -uo pipefail
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/raysite.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/gpu/test_mla_moe_kernels.py tests/gpu/test_decode_graphs.py \
    "tests/gpu/test_paged_decode.py::test_triton_paged_decode_is_graph_safe" -p no:cacheprovider \
    2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
python3 -m app.bench.load --pp 1 --device cuda --parts decode --decode-tokens 48 --reps 2 \
    --run-ahead --out "$OUT/decode_graphs_runahead.json" 2>&1 | grep -v "^(raylet)" | tail -4
timeout 240 python3 -m app.bench.engine --model-shape deepseek-v2-lite --pp 1 \
    --linear torch,triton-persistent --runs 32768:4096 --modes auto --reps 1 \
    --out "$OUT/deepseek_v2_lite_pp1.json" 2>&1 | grep -v "^(raylet)" | tail -12

#!/usr/bin/env bash
# One H200, issues 23/24: DeepSeek-V3.2 decode with FP8 weights and the FP8 latent KV cache in
# CUDA graphs (branch fp8graph). First the GPU tests of what it changed: the fused 1 x 128
# activation quantizer against fp8_ref bit for bit, the W8A8 linears and FP8 experts it now
# feeds, the V3.2 stage FP8 against bf16, and the DeepSeek decode graphs (bf16, and FP8
# weights / FP8 latent / both: graphed == eager on both graph shapes; the engine's graphed
# tokens == --enforce-eager's with --quantization fp8 --kv-cache-dtype fp8). Then V3.2-bench
# decode at 512 rows x 64 outputs with both FP8 formats, graphed (--no-reference: the graph
# reference loop is bf16 only). Each step under `timeout`; the whole under 330 s.
# Run from the checkout to test; carry .gpu (Ray) and .wt/lead (sgl-flash-mla, llguidance), found
# under ROOT (default: here; ROOT=../.. from .wt/<name>). Logs and JSON under $OUT (3 files).
set -uo pipefail
ROOT=${ROOT:-.}
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf "$ROOT/.gpu/raysite.tar.xz")
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$ROOT"/.wt/lead/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { echo "=== [$SECONDS s] $*" | tee -a "$OUT/fp8_graphs_bench.log"; }

step gpu tests
F=tests/gpu/test_fp8_kernels.py
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    "$F::test_fused_activation_quantizer_matches_reference" \
    "$F::test_w8a8_linear_matches_reference" "$F::test_fp8_experts_match_reference" \
    "$F::test_v32_stage_fp8_against_bf16" tests/gpu/test_deepseek_decode_graphs.py 2>&1 \
    | grep -v "^(raylet)" | tail -40 | tee "$OUT/gpu_tests_fp8_graphs.log"

step V3.2-bench decode at 512 rows, FP8 weights + FP8 KV, graphed
timeout 110 python3 -m app.bench.load --model-shape deepseek-v32-bench --pp 1 --device cuda \
    --parts decode --decode-concurrency 512 --decode-tokens 64 --reps 1 --decode-modes auto \
    --run-ahead --no-reference --quantization fp8 --kv-cache-dtype fp8 \
    --out "$OUT/deepseek_v32_fp8_decode_512_graphs.json" 2>&1 | grep -v "^(raylet)" \
    | grep "loaded\|decode graphs\|tok/s\|Error\|error" | tail -12 | tee -a "$OUT/fp8_graphs_bench.log"
step done

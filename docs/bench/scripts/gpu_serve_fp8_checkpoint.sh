#!/usr/bin/env bash
# One H200, issue 24's "an FP8 checkpoint works through `ppserve serve` on CUDA": a 4-layer
# V3.2-bench checkpoint written in DeepSeek's own FP8 format (app/bench/fp8_checkpoint.py) served
# with the quantization its config names and `--kv-cache-dtype fp8`, reached with the official
# openai client; its logits against the checkpoint dequantized to bf16; the `--quantization none`
# server's greedy tokens beside the FP8 one's (tests/gpu/test_serve_fp8_checkpoint.py).
# Carry .gpu (Ray), .wt/lead (whl: sgl-flash-mla, llguidance; whl_openai: openai 3.57.0 and the
# dependencies the Ray archive lacks: httpx2, httpcore2, truststore, jiter, sniffio). Run from the
# repository root, or from .wt/<name> beside them. Writes under $OUT: serve_fp8_checkpoint.json,
# gpu_serve_fp8_checkpoint.log (pytest), serve_fp8_checkpoint.log, serve_bf16_dequantized.log.
set -uo pipefail
C=.; [ -d .gpu ] || C=../..  # where .gpu and .wt/lead are
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf "$C/.gpu/raysite.tar.xz")
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$C"/.wt/lead/whl/*.whl "$C"/.wt/lead/whl_openai/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
python3 -c "import openai, ray; print('openai', openai.__version__, 'ray', ray.__version__)"
timeout 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfEs \
    tests/gpu/test_serve_fp8_checkpoint.py > "$OUT/gpu_serve_fp8_checkpoint.log" 2>&1
echo "pytest rc $?"
tail -25 "$OUT/gpu_serve_fp8_checkpoint.log"

#!/usr/bin/env bash
# Session 32, call 2 (one H100 or H200; carry .gpu, .whl, .commit): call 1's FP8 TTFT suite row
# (DeepGEMM in the MoE and the indexer, a fresh machine's cold Triton cache) timed out at 140 s
# with no output, so the engine bench runs here directly, its log kept, on the kernels every
# user without DeepGEMM gets (Triton's MoE and indexer): the experts' warm-up at startup
# (319f609) through the engine on a GPU, and the rows beside session 31's on an H100; then the
# hyper-connection kernels at a few _finish tiles (app.bench.hyper).
set -u
. docs/bench/scripts/host_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
LIMIT=${LIMIT_TTFT:-400} step ttft_fp8 python3 -m app.bench.engine --model-shape deepseek-v4-flash \
  --pp 1 --linear auto --runs 65536:8192,131072:8192,262144:8192 --modes auto --reps 1 \
  --quantization fp8 --kv-cache-dtype fp8 --out "$R/ttft_fp8.json"
grep -in "warm\|ttft\|error\|Traceback" "$R/ttft_fp8.log" | cut -c1-300 | head -40
LIMIT=90 step hyper python3 -m app.bench.hyper --tokens 8192,2048 --out "$R/hyper.json"
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

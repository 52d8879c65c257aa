#!/usr/bin/env bash
# Session 27, call 5 (one GPU; carry as call 4): V4-Flash FP8 TTFT at 256K with this session's
# decode changes (PDL launches, the scales a step ahead) against a copy with both off
# (/tmp/bothoff), interleaved; then the batched-vs-alone engine test of V4 with prompts around
# the top-k compaction's first line (4,608 tokens), bf16 and FP8, in the time left.
set -u
. docs/bench/scripts/host_env.sh
rm -rf /tmp/bothoff && mkdir -p /tmp/bothoff && cp -r app stages docs /tmp/bothoff/
sed -i 's/^ENABLED = True$/ENABLED = False/' /tmp/bothoff/stages/kernels/pdl.py
sed -i 's/^    SCALES_AHEAD = tl.constexpr(True)$/    SCALES_AHEAD = tl.constexpr(False)/' \
  /tmp/bothoff/stages/kernels/triton_gemm.py
grep -c "^ENABLED = False$\|SCALES_AHEAD = tl.constexpr(False)$" /tmp/bothoff/stages/kernels/pdl.py \
  /tmp/bothoff/stages/kernels/triton_gemm.py
T="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto --runs 262144:8192 --modes auto --reps 2 --quantization fp8 --kv-cache-dtype fp8"
LIMIT=200 step on_1 $T --out "$R/on_1.json"
LIMIT=150 step off_1 bash -c "cd /tmp/bothoff && PYTHONPATH=/tmp/site:/tmp/bothoff $T --out $R/off_1.json"
grep -h "TTFT" $R/on_*.log $R/off_*.log
left=$((${DEADLINE:-570} - SECONDS))
[ $left -gt 60 ] && LIMIT=$((left - 5)) step batched python3 -m pytest -rA -q -m gpu \
  -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and (bf16 or fp8)"
tar czf "$OUT/results.tgz" -C "$OUT" r

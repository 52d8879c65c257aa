#!/usr/bin/env bash
# Session 25, call 2 (one GPU; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the MoE's
# gate/up GEMM with its SwiGLU and the down GEMM's quantizer in the epilogue through TMA at the
# prefill tiles (triton_moe_fp8.PREFILL_SWIGLU): its GPU tests, its kernel against the GEMM then
# the quantizer (2-4 stages), and V4-Flash FP8 TTFT at 256K with it on and off (a copy of the
# tree in /tmp/off with PREFILL_SWIGLU = False), interleaved, two runs each.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=150 step gpu_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_fp8_kernels.py -k "fused_gate_up or experts_match"
LIMIT=60 step moe_swiglu python3 -m app.bench.fp8 --moe-swiglu --out "$R/moe_swiglu.json"
rm -rf /tmp/off && mkdir -p /tmp/off && cp -r app stages docs /tmp/off/
sed -i 's/^PREFILL_SWIGLU, PREFILL_SWIGLU_TILES = True,/PREFILL_SWIGLU, PREFILL_SWIGLU_TILES = False,/' \
  /tmp/off/stages/kernels/triton_moe_fp8.py
grep -c "^PREFILL_SWIGLU, PREFILL_SWIGLU_TILES = False" /tmp/off/stages/kernels/triton_moe_fp8.py
T="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto --runs 262144:8192 --modes auto --reps 2 --quantization fp8 --kv-cache-dtype fp8"
for i in 1 2; do
  LIMIT=200 step on_$i $T --out "$R/on_$i.json"
  LIMIT=200 step off_$i bash -c "cd /tmp/off && PYTHONPATH=/tmp/site:/tmp/off $T --out $R/off_$i.json"
  [ $SECONDS -gt ${DEADLINE:-480} ] && break
done
grep -h "TTFT" $R/on_*.log $R/off_*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 27, call 4 (one GPU; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the Triton
# kernels launched with programmatic dependent launch (stages/kernels/pdl.py, ENABLED in the
# tree) and the block-scaled K loops' scales a step ahead (triton_gemm.SCALES_AHEAD, on):
# V4-Flash's FP8 decode step in graphs at 1 and 512 rows, context 512, the tree against a copy
# with PDL off (/tmp/pdloff) and one with the scales' prefetch off (/tmp/soff); then the GPU
# tests of the decode graphs (graphed == eager == the general path, the engine's tokens ==
# --enforce-eager's) and of the FP8 kernels, with PDL on.
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
for v in pdloff soff; do rm -rf /tmp/$v && mkdir -p /tmp/$v && cp -r app stages docs tests /tmp/$v/; done
sed -i 's/^ENABLED = True$/ENABLED = False/' /tmp/pdloff/stages/kernels/pdl.py
sed -i 's/^    SCALES_AHEAD = tl.constexpr(True)$/    SCALES_AHEAD = tl.constexpr(False)/' \
  /tmp/soff/stages/kernels/triton_gemm.py
grep -c "^ENABLED = False$" /tmp/pdloff/stages/kernels/pdl.py
grep -c "SCALES_AHEAD = tl.constexpr(False)$" /tmp/soff/stages/kernels/triton_gemm.py
D="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,512"
LIMIT=170 step decode_on_1 $D --out "$R/decode_on_1.json"
# step runs its command under timeout, so a copy's run is a bash -c, not a shell function
for v in pdloff soff; do
  LIMIT=110 step decode_${v}_1 bash -c "cd /tmp/$v && PYTHONPATH=/tmp/site:/tmp/$v $D --out $R/decode_${v}_1.json"
done
left=$((${DEADLINE:-575} - SECONDS))
[ $left -gt 60 ] && LIMIT=$((left - 5)) step gpu_tests $GPU_PYTEST tests/gpu/test_deepseek_v4_decode_graphs.py \
  "${KERNEL_TESTS[@]:0:5}" tests/gpu/test_triton_hyper.py tests/gpu/test_triton_rope.py
grep -h '"rows"' $R/decode_*.log | cut -c1-400
tar czf "$OUT/results.tgz" -C "$OUT" r

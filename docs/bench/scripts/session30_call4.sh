#!/usr/bin/env bash
# Session 30, call 4 (whichever GPU comes; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit,
# .gpu-deepgemm; .ab, untracked, rides along): calls 1 and 3 as one, for the few minutes of
# device time left. Both: the GPU tests of v4_pick_slots and the SwiGLU quantizer's launch; the
# FP8 decode step at 1 and 16 rows, the tree against a copy with 0387d4b's V4 attention files
# (.ab), interleaved; V4's staggered, batched FP8 requests against alone. On an H200 also the
# bf16 decode step in graphs at 1-512 rows and the TTFT rows in bf16 and FP8; on an H100 (the
# bf16 stage does not fit) DeepGEMM's build and probe instead.
set -u
. docs/bench/scripts/host_env.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
D=${DEADLINE:-540}
LIMIT=80 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_v4_paged_index_cuda.py tests/gpu/test_fp8_kernels.py -k "pick_slots or swiglu or experts"
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r app stages docs /tmp/base/
cp .ab/flash_mla_v4.py /tmp/base/stages/kernels/
cp .ab/backend.py .ab/attention.py /tmp/base/stages/models/deepseek_v4/
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
ab() {
  for v in tree base; do
    dir=$PWD; [ $v = tree ] || dir=/tmp/base
    LIMIT=60 step decode_${v}_$1 bash -c \
      "cd $dir && PYTHONPATH=/tmp/site:$dir $DEC --out $R/decode_${v}_$1.json"
  done
}
ab 1
if [[ $gpu == *H200* ]]; then
  LIMIT=60 step v4_decode_bf16 python3 -m app.bench.v4_decode --context 512 \
    --rows 1,16,64,256,512 --out "$R/v4_decode_bf16.json"
  LIMIT=170 step ttft-v4-flash python3 -m app.cli bench suite \
    --only ttft-v4-flash,ttft-v4-flash-fp8 --device cuda --timeout 115 --out "$R/suite"
else
  ab 2
fi
left=$((D - SECONDS))
[ $left -gt 60 ] && LIMIT=$((left - 10 < 150 ? left - 10 : 150)) step batched_fp8 python3 -m pytest \
  -rA -q -m gpu -p no:cacheprovider tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and fp8"
left=$((D - SECONDS))
if [[ $gpu == *H200* ]]; then
  [ $left -gt 75 ] && ab 2
elif [ $left -gt 150 ]; then
  LIMIT=$((left - 60 < 150 ? left - 60 : 150)) step build_dg bash .gpu-deepgemm/deepgemm_build.sh \
    .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
  left=$((D - SECONDS))
  [ -f /tmp/dg/env.sh ] && [ $left -gt 30 ] && LIMIT=$((left - 5)) step probe_dg bash -c \
    ". /tmp/dg/env.sh && OUT=$R/dg PROBE_LIMIT=40 bash .gpu-deepgemm/probe.sh"
fi
grep -h "ms_per_step" $R/decode_*.log | cut -c1-240
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

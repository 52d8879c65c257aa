#!/usr/bin/env bash
# Session 30, call 3 (one H100 or H200: FP8 only; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw,
# .commit, .gpu-deepgemm; .ab, untracked, rides along): the GPU tests of v4_pick_slots and the
# SwiGLU quantizer's launch; the FP8 decode step at 1 and 16 rows, the tree against a copy with
# 0387d4b's V4 attention files (.ab: the picks' slots by torch's five launches and the indexer's
# mask, FlashMLA's sinks padded by a copy), two rounds interleaved; V4's staggered, batched FP8
# requests against alone; then DeepGEMM's build and probe (session30_call2.sh's first half).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-575}
LIMIT=80 step kernel_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_v4_paged_index_cuda.py tests/gpu/test_fp8_kernels.py -k "pick_slots or swiglu or experts"
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r app stages docs /tmp/base/
cp .ab/flash_mla_v4.py /tmp/base/stages/kernels/
cp .ab/backend.py .ab/attention.py /tmp/base/stages/models/deepseek_v4/
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
for round in 1 2; do
  for v in tree base; do
    dir=$PWD; [ $v = tree ] || dir=/tmp/base
    LIMIT=60 step decode_${v}_$round bash -c \
      "cd $dir && PYTHONPATH=/tmp/site:$dir $DEC --out $R/decode_${v}_$round.json"
  done
done
LIMIT=150 step batched_fp8 python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and fp8"
left=$((D - SECONDS))
if [ $left -gt 150 ]; then
  LIMIT=$((left > 250 ? 150 : left - 90)) step build_dg bash .gpu-deepgemm/deepgemm_build.sh \
    .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
  left=$((D - SECONDS))
  [ -f /tmp/dg/env.sh ] && [ $left -gt 30 ] && LIMIT=$((left - 10)) step probe_dg bash -c \
    ". /tmp/dg/env.sh && OUT=$R/dg PROBE_LIMIT=45 bash .gpu-deepgemm/probe.sh"
fi
grep -h "ms_per_step" $R/decode_*.log | cut -c1-300
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

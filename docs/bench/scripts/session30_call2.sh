#!/usr/bin/env bash
# Session 30, call 2 (one H100 or H200; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit,
# .gpu-deepgemm): DeepGEMM 2.6.1 (54e2261, the commit session 12 built) built from source against
# the host's torch 2.11 / CUDA 13.0 with -g, then its first JIT calls under a native-backtrace
# handler (docs/bench/scripts/segv_backtrace.c; .gpu-deepgemm/probe.sh: session 12's order, then
# transpose_fp32 / bf16_gemm_nt / fp8_gemm_nt each alone, addr2line on deep_gemm's frames). If
# fp8_gemm_nt crashes, a second build with Ubuntu's g++ (DG_CXX=/usr/bin/g++) instead of
# python's /opt/gcc. Where a build's fp8_gemm_nt runs: app.bench.deepgemm (the grouped MoE GEMMs
# and the dense W8A8 linears beside our Triton kernels). Then the SwiGLU quantizer's GPU test.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-575}
works=""
for v in dg dg2; do
  left=$((D - SECONDS)); [ $left -lt 200 ] && break
  cxx=""; [ $v = dg2 ] && cxx=/usr/bin/g++
  LIMIT=200 step build_$v env ${cxx:+DG_CXX=$cxx} bash .gpu-deepgemm/deepgemm_build.sh \
    .gpu-deepgemm/deepgemm-src.tar.xz /tmp/$v
  [ -f /tmp/$v/env.sh ] || continue
  LIMIT=170 step probe_$v bash -c ". /tmp/$v/env.sh && OUT=$R/$v PROBE_LIMIT=60 bash .gpu-deepgemm/probe.sh"
  if grep -q "fp8_gemm_nt: ok" $R/probe_$v.log; then works=$v; break; fi
done
left=$((D - SECONDS))
if [ -n "$works" ] && [ $left -gt 100 ]; then
  LIMIT=$((left - 60)) step dg_bench bash -c ". /tmp/$works/env.sh && export PYTHONPATH=\$PYTHONPATH:/tmp/site:$PWD && python3 -m app.bench.deepgemm --out $R/deepgemm.json"
fi
left=$((D - SECONDS))
[ $left -gt 60 ] && LIMIT=$((left - 10)) step fp8_kernels python3 -m pytest -rA -q -m gpu \
  -p no:cacheprovider tests/gpu/test_fp8_kernels.py -k "swiglu or experts"
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

#!/usr/bin/env bash
# Session 30, call 5 (one H100, the last ~290 s of the session's device time; carry
# .gpu-deepgemm, .commit): call 4 found DeepGEMM 2.6.1's first JIT call segfaulting inside
# std::ostream::_M_insert<long>, a libstdc++ routine compiled into deep_gemm's _C.so by
# /opt/gcc/bin/g++ (python's CXX). Built with Ubuntu's /usr/bin/g++ instead (DG_CXX), then the
# probe's fp8_gemm_nt and bf16_gemm_nt, then the grouped MoE GEMMs beside ours.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -4 "$R/$name.log"; }
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
D=${DEADLINE:-220}
LIMIT=110 step build env DG_CXX=/usr/bin/g++ bash .gpu-deepgemm/deepgemm_build.sh \
  .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg2
nm -DC /tmp/dg2/lib/deep_gemm/_C*.so 2>/dev/null | grep -c " T std::" | sed 's/^/libstdc++ routines defined in _C.so: /'
LIMIT=45 step probe bash -c ". /tmp/dg2/env.sh && gcc -shared -fPIC -o /tmp/segv.so docs/bench/scripts/segv_backtrace.c; LD_PRELOAD=/tmp/segv.so python3 .gpu-deepgemm/dg_probe.py fp8_gemm_nt bf16_gemm_nt" 
left=$((D - SECONDS))
[ $left -gt 30 ] && LIMIT=$((left - 5)) step dg_bench bash -c ". /tmp/dg2/env.sh && export PYTHONPATH=\$PYTHONPATH:$PWD && python3 -m app.bench.deepgemm --skip-dense --out $R/deepgemm.json"
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

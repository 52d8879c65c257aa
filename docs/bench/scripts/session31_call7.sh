#!/usr/bin/env bash
# Session 31, call 7 (one H200, the last ~300 s of the session's device time; carry .gpu, .whl,
# .commit, .gpu-deepgemm): DeepGEMM built, then V4-Flash's FP8 TTFT rows (64K-256K) with its
# grouped GEMMs in the MoE, in whatever time is left.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-190}
LIMIT=100 step build_dg env DG_CXX=/usr/bin/g++ bash .gpu-deepgemm/deepgemm_build.sh \
  .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
printf '#!/usr/bin/env bash\n. /tmp/dg/env.sh && export DG_JIT_DEBUG=0 DG_JIT_PRINT_COMPILER_COMMAND=0 && exec "$@"\n' > /tmp/with_dg
chmod +x /tmp/with_dg
left=$((D - SECONDS))
LIMIT=$((left - 3)) step ttft_fp8_deepgemm /tmp/with_dg python3 -m app.cli bench suite --only \
  ttft-v4-flash-fp8 --device cuda --timeout $((left - 6)) --out "$R/suite_fp8"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

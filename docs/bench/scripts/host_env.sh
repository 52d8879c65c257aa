# Sourced by a device call's script (session13_*.sh) on the GPU host, from the repository root:
# unpacks what the call carries (.gpu's Ray, .whl's wheels, .tfw's trimmed transformers) under
# /tmp/site once per warm machine, exports the environment every step needs, and defines
# `step NAME CMD...`: CMD under ${LIMIT:-300} s, its log in $R/NAME.log (results under $OUT/r);
# `run NAME SECONDS CMD...`: step CMD if SECONDS are left before ${DEADLINE:-575} s of the script;
# `use_deepgemm`: DeepGEMM built from .gpu-deepgemm (once per warm machine) and /tmp/with_dg,
# which runs a command with deep_gemm importable and its JIT logs quiet (a file: timeout runs
# programs, not shell functions).
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -3 "$R/$name.log"; }
run() { local name=$1 need=$2; shift 2; local left=$((${DEADLINE:-575} - SECONDS))
  if [ $left -gt $need ]; then LIMIT=$((left - 5 < need ? left - 5 : need)) step "$name" "$@"; else echo "skipped $name ($left s left)"; fi; }
use_deepgemm() {
  test -f /tmp/dg/env.sh || LIMIT=${1:-110} step build_dg env DG_CXX=/usr/bin/g++ \
    bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
  printf '#!/usr/bin/env bash\n. /tmp/dg/env.sh && export DG_JIT_DEBUG=0 DG_JIT_PRINT_COMPILER_COMMAND=0 && exec "$@"\n' > /tmp/with_dg
  chmod +x /tmp/with_dg; }
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || test ! -f .tfw/tf-slim.tar.xz || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)

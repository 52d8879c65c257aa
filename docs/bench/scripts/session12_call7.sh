#!/usr/bin/env bash
# Session 12, call 7 (one H200, no Ray): DeepGEMM's last tagged release (v2.1.1.post3) built
# instead of main 54e2261, whose JIT kernels segfaulted at their first call (calls 1, 2, 5);
# its smallest calls probed, then app.bench.deepgemm if they run.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -8 "$R/$name.log"; }
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
DG_TREE=v2.1.1.post3 LIMIT=130 step dg_build bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg211
. /tmp/dg211/env.sh
LIMIT=40 step dg_probe python3 -X faulthandler docs/bench/scripts/session12_dg_probe.py
if grep -q "fp8_gemm_nt: ok" "$R/dg_probe.log"; then
  LIMIT=120 step dg_bench python3 -m app.bench.deepgemm --jit-workers 12 --out "$R/deepgemm.json"
fi
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 12, call 2 (one H200, no Ray): the carried wheels and a trimmed transformers 5.24
# (deepseek_v2/v3/v32/v4, llama, auto: for the GPU tests that write V4 checkpoints) into
# /tmp/site for the next call; DeepGEMM rebuilt, its smallest calls probed in one process with
# faulthandler and the JIT's debug output, then app.bench.deepgemm without worker processes.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -6 "$R/$name.log"; }
mkdir -p /tmp/site
step wheels python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
step tf python3 -c "import transformers; print(transformers.__version__); from transformers import DeepseekV4Config, AutoModelForCausalLM; print('v4 ok')"
[ -f /tmp/dg/env.sh ] || LIMIT=200 step dg_build bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
. /tmp/dg/env.sh
nm -D /tmp/dg/lib/deep_gemm/_C*.so | grep -c " U cu" > "$R/dg_undefined_cu.txt" 2>&1
ldd /tmp/dg/lib/deep_gemm/_C*.so > "$R/dg_ldd.txt" 2>&1
LIMIT=120 DG_JIT_DEBUG=1 DG_JIT_PRINT_COMPILER_COMMAND=1 step dg_probe python3 -X faulthandler docs/bench/scripts/session12_dg_probe.py
LIMIT=240 step dg_bench python3 -X faulthandler -m app.bench.deepgemm --jit-workers 0 --out "$R/deepgemm.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

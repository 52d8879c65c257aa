#!/usr/bin/env bash
# Session 12, call 1 (one H200, no Ray): installs the carried wheels (.whl: sgl-flash-mla,
# llguidance; .tfw: transformers 5.25 + huggingface_hub 2.4 + kernels, for the GPU tests that write
# V4 checkpoints) into /tmp/site, which the next call on the warm machine reuses; then builds
# DeepGEMM from source (.gpu-deepgemm, kept out of git) and runs app.bench.deepgemm.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -4 "$R/$name.log"; }
mkdir -p /tmp/site
step wheels python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .tfw/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
step tf python3 -c "import transformers, huggingface_hub; print(transformers.__version__, huggingface_hub.__version__); from transformers import DeepseekV4Config; print('v4 ok')"
LIMIT=280 step dg_build bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
if [ -f /tmp/dg/env.sh ]; then . /tmp/dg/env.sh; fi
LIMIT=240 step dg_bench python3 -m app.bench.deepgemm --out "$R/deepgemm.json"
cp /tmp/dg/build-*.log "$R/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$OUT" r

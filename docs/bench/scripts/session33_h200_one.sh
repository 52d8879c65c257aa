#!/usr/bin/env bash
# Session 33, the H200 rows of record in one call (carry .gpu, .whl, .commit, .gpu-deepgemm),
# most wanted first, each run only while time is left: DeepGEMM built; V4-Flash FP8 TTFT at
# 512K and 1,040,384 tokens with DeepGEMM's grouped GEMMs in the MoE (an H200-only row); the
# same at 64K-256K; the bf16 decode steps in graphs (the bf16 stage does not fit an H100); the
# FP8 decode steps with their small launches' sources (--stacks). The engine bench runs
# directly, its log kept; `ppserve bench suite --adopt ROW=JSON` makes its JSON a row's result.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-575}
test -f /tmp/dg/env.sh || LIMIT=110 step build_dg env DG_CXX=/usr/bin/g++ \
  bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
printf '#!/usr/bin/env bash\n. /tmp/dg/env.sh && export DG_JIT_DEBUG=0 DG_JIT_PRINT_COMPILER_COMMAND=0 && exec "$@"\n' > /tmp/with_dg
chmod +x /tmp/with_dg
# run NAME SECONDS CMD...: CMD if SECONDS are left before the deadline
run() { local name=$1 need=$2; shift 2; local left=$((D - SECONDS))
  if [ $left -gt $need ]; then LIMIT=$((left - 5 < need ? left - 5 : need)) step "$name" "$@"; else echo "skipped $name ($left s left)"; fi; }
ENGINE="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto
  --modes auto --reps 1 --quantization fp8 --kv-cache-dtype fp8"
run ttft_1m_fp8_deepgemm 230 /tmp/with_dg $ENGINE --runs 524288:8192,1040384:8192 \
  --out "$R/ttft_1m_fp8_deepgemm.json"
run ttft_fp8_deepgemm 160 /tmp/with_dg $ENGINE --runs 65536:8192,131072:8192,262144:8192 \
  --out "$R/ttft_fp8_deepgemm.json"
run v4_decode_bf16 75 python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 \
  --out "$R/v4_decode_bf16.json"
run v4_decode_fp8 60 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,512 --stacks --out "$R/v4_decode_fp8.json"
grep -ih "ttft\|error\|Traceback\|ms a step" $R/*.log | cut -c1-240 | head -40
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

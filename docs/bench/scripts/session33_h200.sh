#!/usr/bin/env bash
# Session 33, the H200 rows of record (carry .gpu, .whl, .commit, .gpu-deepgemm). PART=1 on a
# fresh machine: DeepGEMM built (skipped when a warm machine has it), the FP8 decode steps with
# their small launches' sources (--stacks), V4-Flash's FP8 TTFT at 64K-256K with DeepGEMM's
# grouped GEMMs in the MoE, the bf16 decode steps (the bf16 stage does not fit an H100).
# PART=2 on the same warm machine: 512K and 1,040,384 tokens in FP8 with DeepGEMM, then the
# bf16 TTFT rows (FP8 against bf16 at 256K). The engine bench runs directly, its log kept: the
# suite's row timed out on a fresh machine's cold compiles in session 32.
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
  --modes auto --reps 1"
FP8="--quantization fp8 --kv-cache-dtype fp8"
if [ "${PART:-1}" = 1 ]; then
  run v4_decode_fp8 100 python3 -m app.bench.v4_decode --context 512 $FP8 --rows 1,16,512 \
    --stacks --out "$R/v4_decode_fp8.json"
  run ttft_fp8_deepgemm 300 /tmp/with_dg $ENGINE $FP8 \
    --runs 65536:8192,131072:8192,262144:8192 --out "$R/ttft_fp8_deepgemm.json"
  run v4_decode_bf16 80 python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 \
    --out "$R/v4_decode_bf16.json"
else
  run ttft_1m_fp8_deepgemm 280 /tmp/with_dg $ENGINE $FP8 \
    --runs 524288:8192,1040384:8192 --out "$R/ttft_1m_fp8_deepgemm.json"
  run ttft_bf16 240 $ENGINE --quantization none --kv-cache-dtype auto \
    --runs 65536:8192,131072:8192,262144:8192 --out "$R/ttft_bf16.json"
fi
grep -ih "ttft\|error\|Traceback\|ms a step" $R/*.log | cut -c1-240 | head -40
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

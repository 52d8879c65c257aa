#!/usr/bin/env bash
# Issue 34's bf16 one-row V4-Flash decode step (carry .whl .commit; v4_decode needs no Ray).
# On an H200 the shape itself (h200_rows_of_record.sh v4rows). On an H100 the bf16 stage (256
# experts a layer, ~103 GB) does not fit, so the stage with 128 routed experts a layer: a one-row
# step reads its 6 picks and the shared expert whatever the count. The FP8 stage at 128 and at 256 experts on
# the same machine shows what the count changes at one and 16 rows.
set -u
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -gt 100000 ]; then exec bash docs/bench/scripts/h200_rows_of_record.sh v4rows; fi
# no .gpu carried: host_env's unpacking of its Ray fails, and is kept quiet
. docs/bench/scripts/host_env.sh 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
DEADLINE=${DEADLINE:-575}
DEC="python3 -m app.bench.v4_decode --context 512 --reps 5 --rows 1,16"
FP8="--quantization fp8 --kv-cache-dtype fp8"
run bf16_e128 110 $DEC --routed-experts 128 --out "$R/v4_decode_bf16_e128.json"
run fp8_e128 70 $DEC --routed-experts 128 $FP8 --out "$R/v4_decode_fp8_e128.json"
run fp8_e256 70 $DEC $FP8 --out "$R/v4_decode_fp8_e256.json"
grep -h "ms\|Error" "$R"/*.log | cut -c1-200 | head -30

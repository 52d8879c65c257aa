#!/usr/bin/env bash
# Session 38's H200 call for issue 34 (carry .gpu .whl .commit; .gpu's Ray stripped by
# strip_raysite.sh): the V4-Flash stage's decode steps in graphs, bf16 then FP8, at 1, 16 and 512
# rows (the bf16 stage's ~103 GB of experts does not fit an H100), then the issue's own command
# for bf16 through the engine (the suite's decode-v4-flash-512) and, time left, its ITL rows.
# On an H100 it runs session37_bf16_one_row.sh's bound instead.
set -u
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -lt 100000 ]; then exec bash docs/bench/scripts/session37_bf16_one_row.sh; fi
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
DEADLINE=${DEADLINE:-575}
DEC="python3 -m app.bench.v4_decode --context 512 --reps 5 --rows 1,16,512"
SUITE="python3 -m app.cli bench suite --device cuda --out $R/suite"
run v4_decode_bf16 90 $DEC --out "$R/v4_decode_bf16.json"
run v4_decode_fp8 100 $DEC --quantization fp8 --kv-cache-dtype fp8 --out "$R/v4_decode_fp8.json"
run engine_v4_bf16_512 200 $SUITE --only decode-v4-flash-512 --timeout 190
run engine_v4_bf16_itl 150 $SUITE --only decode-v4-flash-itl --timeout 140
grep -ih "error\|Traceback\|ms a step\|tok/s" $R/*.log | cut -c1-240 | head -40

#!/usr/bin/env bash
# Session 26, call 4 (one GPU, the device time left after call 3's refused starts; carry as
# call 3): the 256K last chunk by groups at this session's tree first, then the
# ttft-v4-flash-fp8 rows in the time left (DEADLINE, default 280 s).
set -u
. docs/bench/scripts/host_env.sh
LIMIT=170 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 \
  --out "$R/breakdown_fp8.json"
left=$((${DEADLINE:-280} - SECONDS))
[ $left -gt 90 ] && LIMIT=$left step ttft-v4-flash-fp8 python3 -m app.cli bench suite \
  --only ttft-v4-flash-fp8 --device cuda --timeout $((left - 5)) --out "$R/suite"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

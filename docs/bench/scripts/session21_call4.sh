#!/usr/bin/env bash
# Session 21, call 4 (one H200; carry .gpu .whl .tfw .commit), after call 1's A/Bs have set the
# defaults: issue 34's and 35's FP8 rows through the engine (TTFT 64K-256K, decode at 512 rows),
# the V4 decode stage in graphs and the 256K chunk's groups in bf16 and FP8.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=130 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 \
  --device cuda --timeout 125 --out "$R/suite"
LIMIT=90 step decode-v4-flash-512-fp8 python3 -m app.cli bench suite \
  --only decode-v4-flash-512-fp8 --device cuda --timeout 85 --out "$R/suite"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
for q in fp8 bf16; do
  [ $q = fp8 ] && FLAGS="--quantization fp8 --kv-cache-dtype fp8" || FLAGS=""
  LIMIT=30 step breakdown_$q python3 -m app.bench.deepseek_breakdown --linear auto $FLAGS \
    --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_$q.json"
done
tar czf "$OUT/results.tgz" -C "$OUT" r

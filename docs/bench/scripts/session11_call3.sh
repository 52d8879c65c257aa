#!/usr/bin/env bash
# Session 11, issue 35 on one H200 (Ray carried): the indexer micro-bench and the 256K chunk's
# breakdown after the top-k's Triton group maxima, then the V4-Flash TTFT rows (FP8, bf16) and
# the 512K / 1M FP8 row through the engine. Results under $OUT/r.
set -u
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; }
step indexer_v4 python -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x8192:131072,1x8192:262144,1x8192:1048576,512x1:262144 --out "$R/indexer_v4.json"
for q in fp8 none; do kv=$([ $q = fp8 ] && echo fp8 || echo auto)
  step breakdown_$q python -m app.bench.deepseek_breakdown --linear auto --quantization $q \
    --kv-cache-dtype $kv --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_$q.json"
done
for row in ttft-v4-flash-fp8 ttft-v4-flash ttft-v4-flash-1m-fp8; do
  LIMIT=200 step $row python -m app.cli bench suite --only $row --device cuda --timeout 190 --out "$R/suite"
done
tar czf "$OUT/results.tgz" -C "$OUT" r

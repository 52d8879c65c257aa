#!/usr/bin/env bash
# Session 25, call 4 (one H200: the 1M prompt's scores need its memory; carry .gpu,
# .whl/sgl_flash_mla-*.whl, .tfw, .commit): the tree's V4-Flash FP8 long-prompt rows of record
# after session 24's gathered top-k and indexer cap: 512K and 1,040,384 tokens
# (ttft-v4-flash-1m-fp8), then 64K / 128K / 256K (ttft-v4-flash-fp8) in the time left.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=440 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 \
  --device cuda --timeout 435 --out "$R/suite"
left=$((${DEADLINE:-580} - SECONDS)); LIMIT=$left
[ $left -gt 80 ] && step ttft-v4-flash-fp8 python3 -m app.cli bench suite \
  --only ttft-v4-flash-fp8 --device cuda --timeout $((left - 5)) --out "$R/suite"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

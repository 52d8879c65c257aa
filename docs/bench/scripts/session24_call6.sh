#!/usr/bin/env bash
# Session 24, call 6 (one H100 or H200; carry .gpu .whl/sgl_flash_mla-*.whl .tfw .commit): the
# indexer's top-k over the 256K last chunk's CSA lines (8,192 lines of 64K scores, k 512) with the
# compaction's scores read step by step (the default) and over the taken groups' indices
# (triton_topk.GATHER at 16 / 32 / 64 groups a step), each one's picks against torch's rule.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=120 step topk python3 -m app.bench.indexer_select --topk 512 --no-loop \
  --cases 1x8192:262144 --rate 4 --out "$R/topk.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

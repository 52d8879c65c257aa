#!/usr/bin/env bash
# Session 33, one H100 (carry .gpu, .whl, .commit): the FP8 decode steps in graphs at 1 and 16
# rows with their small launches counted by op and calling frame (--stacks): the fusion
# candidates for issue 34's one-row 2.0 ms, at the tree that ran it.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT=${LIMIT_DECODE:-240} step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 \
  --quantization fp8 --kv-cache-dtype fp8 --rows 1,16 --stacks --out "$R/v4_decode_fp8.json"
grep -h "rows" "$R/v4_decode_fp8.log" | cut -c1-300 | head
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

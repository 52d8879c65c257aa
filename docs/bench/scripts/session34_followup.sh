#!/usr/bin/env bash
# Session 34, the warm machine after session34_decode_linear.sh (carry .commit): the FP8 decode
# step's small launches by source (--stacks), then the headline's engine ITL row
# (decode-v4-flash-itl-fp8) at this tree.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
run stacks 110 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1 --stacks --out "$R/v4_decode_stacks.json"
run suite_itl 300 python3 -m app.cli bench suite --only decode-v4-flash-itl-fp8 --device cuda \
  --out "$R/suite" --timeout 290
grep -h "ms_per_step\|ITL\|itl\|Error" $R/*.log | cut -c1-300 | head -30
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

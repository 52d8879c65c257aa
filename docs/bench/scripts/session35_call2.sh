#!/usr/bin/env bash
# Session 35, call 2, one H100 or H200 (carry .gpu, .whl, .commit): V4's grouped output
# projection (o_a) kept in FP8. Its GPU tests (the decode linear's, o_a's bits either side of
# 32 rows; the V4 decode graph tests, whose FP8 stage now holds o_a in FP8); the FP8 V4-Flash
# decode step in graphs at 1, 16 and 512 rows, the tree against a copy holding o_a in bf16
# (the tree before), two rounds interleaved. Ran at 2fcf895; the FP8 o_a was removed after
# call 4 (docs/PERFORMANCE.md), so at later trees the copy and the tree are the same.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
B=/tmp/before_o_a; rm -rf $B; mkdir -p $B; cp -a app stages docs $B/
sed -i 's/fp8=fp8_o_a, tp=tp/fp8=False, tp=tp/' $B/stages/models/deepseek_v4/attention.py
grep -c "fp8=False, tp=tp" $B/stages/models/deepseek_v4/attention.py
run kernel_tests 90 python3 -m pytest -q tests/gpu/test_fp8_decode_linear_cuda.py
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16,512"
run decode_tree_0 90 $DEC --out "$R/decode_tree_0.json"  # the first compiles
for round in 1 2; do
  run "decode_before_$round" 60 env -C $B PYTHONPATH=/tmp/site:$B $DEC \
    --out "$R/decode_before_$round.json"
  run "decode_tree_$round" 50 $DEC --out "$R/decode_tree_$round.json"
done
run graphs 120 python3 -m pytest -q -x tests/gpu/test_deepseek_v4_decode_graphs.py
grep -h "passed\|failed\|Error" $R/*.log | cut -c1-240 | head -20
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/decode_*.json")):
    d = json.load(open(f))
    print(f.split("/")[-1], {r: v["graph"]["ms_per_step"] for r, v in d["rows"].items()})
PY
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

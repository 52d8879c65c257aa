#!/usr/bin/env bash
# Session 35, call 4, one H100 or H200 (carry .gpu, .whl, .commit), what the device time left
# allows of call 3: o_a's GPU test (its bits in decode batches and a prefill chunk); o_a alone
# at 1-8,192 rows on each FP8 path against the bf16 bmm; the FP8 V4-Flash decode step in graphs
# at 1, 16, 512 rows, the tree and a copy holding o_a in bf16. Ran at 937e73e, whose
# docs/bench/scripts/o_a_timing.py and FP8 o_a were removed after it (docs/PERFORMANCE.md).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-200}
B=/tmp/before_o_a; rm -rf $B; mkdir -p $B; cp -a app stages docs $B/
sed -i 's/fp8=fp8_o_a, tp=tp/fp8=False, tp=tp/' $B/stages/models/deepseek_v4/attention.py
run kernel_tests 45 python3 -m pytest -q tests/gpu/test_fp8_decode_linear_cuda.py -k grouped
run o_a 40 python3 docs/bench/scripts/o_a_timing.py --out "$R/o_a.json"
DEC="python3 -m app.bench.v4_decode --context 512 --rows 1,16,512 --quantization fp8 --kv-cache-dtype fp8"
run decode_tree 80 $DEC --out "$R/decode_tree.json"
run decode_before 30 env -C $B PYTHONPATH=/tmp/site:$B $DEC --out "$R/decode_before.json"
grep -h "passed\|failed\|Error" $R/*.log | cut -c1-240 | head -10
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/decode_*.json")):
    d = json.load(open(f))
    print(f.split("/")[-1], {r: v["graph"]["ms_per_step"] for r, v in d["rows"].items()})
PY
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

#!/usr/bin/env bash
# Session 34, call 3, one H100 or H200 (carry .gpu, .whl, .commit, .tfw): the decode linear now
# reading rows quantized beforehand (call 2's quantized them inside its K loop: 2.35 -> 4.6 ms
# a one-row step), the experts' swapped kernels with 128-wide gate/up groups. Their GPU tests;
# the FP8 V4-Flash decode step in graphs at 1 and 16 rows: the tree, cuBLASLt's linears with
# the swapped experts, the tree before (cuBLASLt, 64-row tiles), two rounds; V4's staggered,
# batched W8A8 and FP8 requests against each alone; the V4 decode graph tests.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
run kernel_tests 80 python3 -m pytest -q tests/gpu/test_fp8_decode_linear_cuda.py \
  tests/gpu/test_fp8_moe_decode_cuda.py tests/gpu/test_fp8_kernels.py -k "decode or moe"
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
for round in 1 2; do
  run "decode_tree_$round" 40 $DEC --out "$R/decode_tree_$round.json"
  run "decode_cublas_$round" 40 $DEC --fp8-linear scaled-mm --out "$R/decode_cublas_$round.json"
  run "decode_before_$round" 40 $DEC --fp8-linear scaled-mm --moe-decode tiles \
    --out "$R/decode_before_$round.json"
done
run batched 200 python3 -m pytest -q -x tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and (fp8 or w8a8)" -rA
run graphs 110 python3 -m pytest -q -x tests/gpu/test_deepseek_v4_decode_graphs.py
grep -h "passed\|failed\|Error" $R/*.log | cut -c1-240 | head -20
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/decode_*.json")):
    d = json.load(open(f))
    print(f.split("/")[-1], {r: v["graph"]["ms_per_step"] for r, v in d["rows"].items()})
PY
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

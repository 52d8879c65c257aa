#!/usr/bin/env bash
# Session 35, call 3, one H200 (or H100; carry .gpu, .whl, .commit): o_a kept in
# FP8 on the decode linear's kernel at every row count (call 2's pointer GEMM a group was 1 ms
# slower at 512 rows). Its GPU test; o_a alone at decode and prefill row counts against the
# bf16 bmm; the FP8 V4-Flash decode step in graphs at 1, 16, 512 rows, the tree against a copy
# holding o_a in bf16; the bf16 decode step (an H200's: the bf16 stage does not fit an H100);
# V4's staggered, batched W8A8 and FP8 requests against each alone (FLASH_V4's o_a is FP8);
# the FP8 TTFT rows at 64K-256K through the suite (DeepGEMM left out: the carry's 64 MiB).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-430}  # what the session's device budget had left
B=/tmp/before_o_a; rm -rf $B; mkdir -p $B; cp -a app stages docs $B/
sed -i 's/fp8=fp8_o_a, tp=tp/fp8=False, tp=tp/' $B/stages/models/deepseek_v4/attention.py
run kernel_tests 60 python3 -m pytest -q tests/gpu/test_fp8_decode_linear_cuda.py
run o_a 40 python3 docs/bench/scripts/o_a_timing.py --out "$R/o_a.json"
DEC="python3 -m app.bench.v4_decode --context 512 --rows 1,16,512"
run decode_fp8_tree 100 $DEC --quantization fp8 --kv-cache-dtype fp8 --out "$R/decode_fp8_tree.json"
run decode_fp8_before 40 env -C $B PYTHONPATH=/tmp/site:$B $DEC --quantization fp8 \
  --kv-cache-dtype fp8 --out "$R/decode_fp8_before.json"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && \
  run decode_bf16 80 $DEC --out "$R/decode_bf16.json"
run batched 160 python3 -m pytest -q -x tests/gpu/test_batched_vs_alone_cuda.py \
  -k "v4 and (fp8 or w8a8)" -rA
SUITE="python3 -m app.cli bench suite --device cuda --out $R/suite"
run ttft_fp8 160 $SUITE --only ttft-v4-flash-fp8 --timeout 150
grep -h "passed\|failed\|Error\|TTFT\|ttft" $R/*.log | cut -c1-240 | head -20
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/decode_*.json")):
    d = json.load(open(f))
    print(f.split("/")[-1], {r: v["graph"]["ms_per_step"] for r, v in d["rows"].items()})
PY
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

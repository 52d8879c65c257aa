#!/usr/bin/env bash
# Session 34, call 4 (carry .commit; .gpu, .whl on a fresh machine): call 3's one-row and
# 16-row A/B again (its first tree run timed out compiling): the tree against the tree before
# (cuBLASLt's linears, the experts' 64-row tiles), two rounds, then the decode linear's shapes
# against cuBLASLt (app.bench.fp8_decode_linear, rows quantized beforehand now).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-200}
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
for round in 1 2; do
  run "decode_tree_$round" 60 $DEC --out "$R/decode_tree_$round.json"
  run "decode_before_$round" 40 $DEC --fp8-linear scaled-mm --moe-decode tiles \
    --out "$R/decode_before_$round.json"
done
run shapes 40 python3 -m app.bench.fp8_decode_linear --rows 1,16 --out "$R/decode_linear.json"
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/decode_*.json")):
    d = json.load(open(f))
    if "rows" in d and isinstance(d["rows"], dict):
        print(f.split("/")[-1], {r: v["graph"]["ms_per_step"] for r, v in d["rows"].items()})
PY
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

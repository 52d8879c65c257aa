#!/usr/bin/env bash
# Session 25, call 3 (one GPU; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the FP8
# activation quantizers' launches (triton_fp8_act.LAUNCH / SWIGLU_LAUNCH, rows a program and
# warps) at V4-Flash's 8K chunk, then V4-Flash FP8 TTFT at 256K with the tree's launches against
# a copy at the sweep's fastest same-bits ones (/tmp/best), interleaved, two runs each.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=90 step act_quantizers python3 -m app.bench.fp8 --act-quantizers --out "$R/act.json"
rm -rf /tmp/best && mkdir -p /tmp/best && cp -r app stages docs /tmp/best/
python3 - "$R/act.json" <<'PY' | tee "$R/best.txt"
import json, re, sys
rows = json.load(open(sys.argv[1]))["act_quantizers"]
p = "/tmp/best/stages/kernels/triton_fp8_act.py"
s = open(p).read()
for case, knob in (("quantize", "LAUNCH"), ("swiglu_quantize", "SWIGLU_LAUNCH")):
    ok = [r for r in rows if r["case"] == case and r.get("same_bits")]
    best = min(ok, key=lambda r: r["ms"])
    s = re.sub(rf"^{knob} = \(\d+, \d+\)$", f"{knob} = ({best['launch'][0]}, {best['launch'][1]})", s, flags=re.M)
    print(case, best)
open(p, "w").write(s)
PY
grep -n "^LAUNCH\|^SWIGLU_LAUNCH" /tmp/best/stages/kernels/triton_fp8_act.py
T="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto --runs 262144:8192 --modes auto --reps 2 --quantization fp8 --kv-cache-dtype fp8"
for i in 1 2; do
  LIMIT=200 step tree_$i $T --out "$R/tree_$i.json"
  LIMIT=200 step best_$i bash -c "cd /tmp/best && PYTHONPATH=/tmp/site:/tmp/best $T --out $R/best_$i.json"
  [ $SECONDS -gt ${DEADLINE:-480} ] && break
done
grep -h "TTFT" $R/tree_*.log $R/best_*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

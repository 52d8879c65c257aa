#!/usr/bin/env bash
# Session 25, call 5 (one GPU; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the rule's
# one-program top-k with its step 3 a sort of the kept keys (triton_rule_topk.SORT) against the
# counted ranks and torch's path, at 512 / 1,024 / 2,048 / 8,192 lines of the compaction's k + 8k
# candidates (k 512); its GPU tests; then, if the sorted kernel beats torch's at 8,192 lines,
# V4-Flash FP8 TTFT at 256K with the kernel for every line count (a copy of the tree in /tmp/all
# with triton_topk.RULE_KERNEL_MAX_LINES = 1 << 30) against the tree, interleaved, two runs each.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=90 step gpu_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_rule_topk_cuda.py
LIMIT=150 step indexer_select python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 512x1:65536,1x1024:65536,1x2048:65536,1x8192:262144 --out "$R/indexer_select.json"
python3 - "$R/indexer_select.json" <<'PY' > "$R/verdict.txt"
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"] if isinstance(d, dict) and "rows" in d else d
for r in rows:
    print(r.get("rows"), r.get("tokens_per_row"), r.get("candidates_torch_ms"), r.get("candidates_rule_kernel_ms"),
          r.get("candidates_rule_kernel_ranked_ms"), r.get("candidates_rule_equals_torch"))
last = rows[-1]
print("GO" if last["candidates_rule_kernel_ms"] < last["candidates_torch_ms"] and last["candidates_rule_equals_torch"] else "STOP")
PY
cat "$R/verdict.txt"
if grep -q GO "$R/verdict.txt"; then
  rm -rf /tmp/all && mkdir -p /tmp/all && cp -r app stages docs /tmp/all/
  sed -i 's/^RULE_KERNEL_MAX_LINES = 512$/RULE_KERNEL_MAX_LINES = 1 << 30/' /tmp/all/stages/kernels/triton_topk.py
  grep -c "^RULE_KERNEL_MAX_LINES = 1 << 30" /tmp/all/stages/kernels/triton_topk.py
  T="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto --runs 262144:8192 --modes auto --reps 2 --quantization fp8 --kv-cache-dtype fp8"
  for i in 1 2; do
    LIMIT=200 step all_$i bash -c "cd /tmp/all && PYTHONPATH=/tmp/site:/tmp/all $T --out $R/all_$i.json"
    [ $SECONDS -gt ${DEADLINE:-400} ] && break
    LIMIT=200 step tree_$i $T --out "$R/tree_$i.json"
    [ $SECONDS -gt ${DEADLINE:-400} ] && break
  done
  grep -h "TTFT" $R/all_*.log $R/tree_*.log
fi
tar czf "$OUT/results.tgz" -C "$OUT" r

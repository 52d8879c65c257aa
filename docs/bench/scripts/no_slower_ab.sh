#!/usr/bin/env bash
# Issue 34's last target, "V3.2-bench, V2-Lite and Llama decode no slower than today", as an A/B
# on one GPU of either kind (H100 or H200: the three fit 80 GB): the tree the issue measured
# (8a07cde) against this one, each row run on both trees in turn with the same `bench load`
# arguments (the suite's decode rows, 256 outputs a request so the ramp weighs less).
# The old tree gets this tree's harness first: dcae6e0 made the decode part stream every token
# (steady-state tok/s, ITL), which alone made the tiny model's microbatch ~1.4x longer on the CPU;
# with both trees streaming they were within 3 % there (docs/PERFORMANCE.md, session 36).
# Compare steady_tokens_per_s, itl_p50_ms and stage_forward_s.
# Here, once:                                  bash docs/bench/scripts/no_slower_ab.sh pack
# then on the host, carry .gpu .whl .commit:  bash docs/bench/scripts/no_slower_ab.sh [SHAPE...]
# (.whl holds llguidance's wheel beside sgl-flash-mla's: 8a07cde imports it at start-up;
# `pip download --no-deps llguidance -d .whl`.)
# (SHAPE: deepseek-v32-bench, deepseek-v2-lite, llama8b; all three by default.)
# `pack own` packs 8a07cde as it was (its own harness: no streaming, the figures the issue
# quotes) as old-8a07cde-own; on the host OLD_HARNESS=own runs that one, TREES picks the trees.
if [ "${1:-}" = pack ]; then
  set -euo pipefail
  d=$(mktemp -d) name=old-8a07cde${2:+-$2}
  git archive 8a07cde app stages pyproject.toml | tar -C "$d" -x
  test "${2:-}" = own || git show dcae6e0 -- app/bench/load.py app/bench/target.py |
    patch -d "$d" -p1 -s
  tar -C "$d" -cJf .gpu/$name.tar.xz . && rm -rf "$d" && ls -la .gpu/$name.tar.xz
  exit 0
fi
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
NAME=old-8a07cde${OLD_HARNESS:+-$OLD_HARNESS} TREES=${TREES:-new old}
OLD=/tmp/$NAME
mkdir -p $OLD && (test -d $OLD/app || tar -C $OLD -xJf .gpu/$NAME.tar.xz)
D="--pp 1 --device cuda --parts decode --reps 1 --decode-modes auto --run-ahead --no-reference"
D="$D --quantization none --kv-cache-dtype auto --decode-tokens 256"
# python -m puts the working directory first on sys.path, and Ray's workers take the driver's:
# the old tree runs from its own folder with the new one off PYTHONPATH.
old() { env -C $OLD PYTHONPATH=/tmp/site PPSERVE_COMMIT=8a07cde python3 -m app.bench.load "$@"; }
export -f old; export OLD
SHAPES=${*:-deepseek-v32-bench deepseek-v2-lite llama8b}
for shape in $SHAPES; do
  case $shape in
    llama8b) set -- 64 ;;
    *) set -- 512 --kv-blocks memory ;;
  esac
  rows=$1; shift
  A="--model-shape $shape $D --decode-concurrency $rows $*"
  case $TREES in *new*)
    run "${shape}_new" 90 python3 -m app.bench.load $A --out "$R/${shape}_new.json" ;; esac
  o=old${OLD_HARNESS:+_$OLD_HARNESS}
  case $TREES in *old*) run "${shape}_$o" 90 bash -c "old $A --out $R/${shape}_$o.json" ;; esac
done
python3 - "$R" <<'EOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    s = json.load(open(f))["decode"]["summary"]["auto"]
    keys = ("steady_tokens_per_s", "itl_p50_ms", "stage_forward_s", "tokens_per_s")
    print(os.path.basename(f), {k: round(s[k], 4) for k in keys if s.get(k) is not None})
EOF
grep -ih "error\|Traceback" $R/*.log | cut -c1-240 | head -20
tar czf "$OUT/ab_${OLD_HARNESS:-}$(echo $SHAPES | tr -c a-z0-9 _).tgz" -C "$OUT" r && rm -rf "$R"

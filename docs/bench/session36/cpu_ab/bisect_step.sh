#!/usr/bin/env bash
# One step of session 36's bisect, kept as the record of its command: `git bisect run` of it in a
# worktree at /tmp/bis/wt (git bisect start 835445a 8a07cde -- stages app); exit 1 above 4.3 ms.
sha=$(git -C /tmp/bis/wt rev-parse --short HEAD)
d=/tmp/bis/t-$sha; rm -rf $d; mkdir -p $d
git -C /tmp/bis/wt archive HEAD app stages pyproject.toml | tar -C $d -x
SP=/work/main/.venv/lib/python3.11/site-packages
A="--model-shape tiny --pp 1 --device cpu --parts decode --reps 3 --decode-modes auto --no-reference --quantization none --kv-cache-dtype auto --decode-tokens 32 --decode-concurrency 4"
cd $d && PYTHONPATH=$SP timeout 200 /work/main/.venv/bin/python -m app.bench.load $A --out $d/r.json > $d/log 2>&1 || exit 125
w=$(python3 -c "import json;s=json.load(open('$d/r.json'))['decode']['summary']['auto'];print(round(s['wall_per_microbatch_s']*1e3,3), round(s['stage_forward_s']*1e3,3))")
echo "$sha $w" | tee -a /tmp/bis/results.txt
python3 -c "import sys; sys.exit(1 if float('$w'.split()[0]) > 4.3 else 0)"

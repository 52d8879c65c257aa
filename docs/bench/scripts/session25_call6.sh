#!/usr/bin/env bash
# Session 25, call 6 (the same warm H100 as call 5, run as one command line; carry as call 5):
# V4-Flash FP8 decode steps at 1 and 512 rows, context 512, eager and in graphs, with the rule
# top-k's step 3 a sort (the tree) against its counted ranks (a copy in /tmp/rk, SORT = False).
. docs/bench/scripts/host_env.sh; rm -rf /tmp/rk && mkdir -p /tmp/rk && cp -r app stages docs /tmp/rk/ && sed -i 's/^SORT = True$/SORT = False/' /tmp/rk/stages/kernels/triton_rule_topk.py && grep -c "^SORT = False" /tmp/rk/stages/kernels/triton_rule_topk.py; D="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,512"; LIMIT=170 step sorted_1 $D --out $R/sorted_1.json; LIMIT=100 step ranked_1 bash -c "cd /tmp/rk && PYTHONPATH=/tmp/site:/tmp/rk $D --out $R/ranked_1.json"; [ $SECONDS -lt 250 ] && LIMIT=60 step sorted_2 $D --out $R/sorted_2.json; tar czf $OUT/results.tgz -C $OUT r

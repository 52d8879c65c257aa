#!/usr/bin/env bash
# Session 24, call 4 (the same warm H100 as call 3, whose part 3 left /tmp/moe: this tree with
# the MoE's prefill launch of before session 23; carry .tfw .commit). Run as one command line:
# 256K FP8 TTFT twice a launch, interleaved, two runs each, to see whether call 3's one-run
# difference (3.877 s at the old launch against 3.926) holds.
. docs/bench/scripts/host_env.sh; T="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto --runs 262144:8192 --modes auto --reps 2 --quantization fp8 --kv-cache-dtype fp8"; LIMIT=110 step moe_old_2 bash -c "cd /tmp/moe && PYTHONPATH=/tmp/site:/tmp/moe $T --out $R/moe_old_2.json"; LIMIT=110 step moe_new_2 $T --out $R/moe_new_2.json; LIMIT=110 step moe_old_3 bash -c "cd /tmp/moe && PYTHONPATH=/tmp/site:/tmp/moe $T --out $R/moe_old_3.json"; LIMIT=110 step moe_new_3 $T --out $R/moe_new_3.json; grep -h TTFT $R/*.log; tar czf $OUT/results.tgz -C $OUT r

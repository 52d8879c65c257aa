#!/usr/bin/env bash
# Session 26, call 1 (one GPU; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the indexer's
# scores kernels writing the top-k's group maxima as they score (indexer_select.MAXIMA_GROUP,
# scores_with_maxima): the GPU tests of the indexer, DSA, the rule's top-k and batched-vs-alone;
# the 256K last chunk's scores and top-k with and without the maxima (app.bench.indexer_select);
# V4-Flash FP8 TTFT at 256K with the models passing the maxima and not (a copy of the tree in
# /tmp/off whose scores_with_maxima passes none), interleaved, two runs each.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=240 step gpu_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider -x \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_dsa_cuda.py tests/gpu/test_rule_topk_cuda.py \
  tests/gpu/test_batched_vs_alone_cuda.py
LIMIT=120 step indexer_select python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x8192:262144,512x1:262144 --out "$R/indexer_select.json"
rm -rf /tmp/off && mkdir -p /tmp/off && cp -r app stages docs /tmp/off/
sed -i 's/^    return score(q, keys, weights, scale, plan, maxima=maxima), maxima$/    return score(q, keys, weights, scale, plan), None/' \
  /tmp/off/stages/kernels/indexer_select.py
grep -c "^    return score(q, keys, weights, scale, plan), None$" /tmp/off/stages/kernels/indexer_select.py
T="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto --runs 262144:8192 --modes auto --reps 2 --quantization fp8 --kv-cache-dtype fp8"
for i in 1 2; do
  LIMIT=200 step on_$i $T --out "$R/on_$i.json"
  [ $SECONDS -gt ${DEADLINE:-450} ] && break
  LIMIT=200 step off_$i bash -c "cd /tmp/off && PYTHONPATH=/tmp/site:/tmp/off $T --out $R/off_$i.json"
  [ $SECONDS -gt ${DEADLINE:-450} ] && break
done
grep -h "TTFT" $R/on_*.log $R/off_*.log
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 26, call 2 (one GPU; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw, .commit): the
# candidates' top-k over each line's live prefix (triton_topk.CANDIDATE_PREFIX, the rule kernel's
# PREFIX_BLOCK launch) beside call 1's group maxima: the GPU tests of the rule's kernel, the
# indexer and DSA; the 256K last chunk's top-k with and without the prefixes
# (app.bench.indexer_select); V4-Flash FP8 TTFT at 256K, the tree against a copy in /tmp/off
# with both of this session's changes off (session 25's path), interleaved; then the batched-vs-
# alone engine tests of V4 in the time left.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=100 step rule_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_rule_topk_cuda.py
LIMIT=150 step indexer_tests python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_indexer_kernel.py tests/gpu/test_dsa_cuda.py
LIMIT=60 step indexer_select python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x8192:262144 --out "$R/indexer_select.json"
rm -rf /tmp/off && mkdir -p /tmp/off && cp -r app stages docs /tmp/off/
sed -i 's/^    return score(q, keys, weights, scale, plan, maxima=maxima), maxima$/    return score(q, keys, weights, scale, plan), None/' \
  /tmp/off/stages/kernels/indexer_select.py
sed -i 's/^CANDIDATE_PREFIX = True$/CANDIDATE_PREFIX = False/' /tmp/off/stages/kernels/triton_topk.py
grep -c "^    return score(q, keys, weights, scale, plan), None$\|^CANDIDATE_PREFIX = False$" \
  /tmp/off/stages/kernels/indexer_select.py /tmp/off/stages/kernels/triton_topk.py
T="python3 -m app.bench.engine --model-shape deepseek-v4-flash --pp 1 --linear auto --runs 262144:8192 --modes auto --reps 2 --quantization fp8 --kv-cache-dtype fp8"
LIMIT=200 step on_1 $T --out "$R/on_1.json"
LIMIT=150 step off_1 bash -c "cd /tmp/off && PYTHONPATH=/tmp/site:/tmp/off $T --out $R/off_1.json"
[ $SECONDS -lt ${DEADLINE:-560} ] && LIMIT=100 step on_2 $T --out "$R/on_2.json"
grep -h "TTFT" $R/on_*.log $R/off_*.log
left=$((${DEADLINE:-560} - SECONDS))
[ $left -gt 60 ] && LIMIT=$left step batched python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_batched_vs_alone_cuda.py -k v4
tar czf "$OUT/results.tgz" -C "$OUT" r

#!/usr/bin/env bash
# Session 33, one H100 or H200 (carry .gpu, .whl, .commit; the tree's untracked .s33base/ holds
# a4df289's V4 attention.py and cache.py): the V4 latent write with the compressor inputs beside
# it (6fae14d) on the GPU: its kernel test, then the FP8 decode step in graphs at 1 and 16 rows,
# the tree against a copy with a4df289's two files (two rounds, interleaved), then V4's staggered,
# batched FP8 requests against each alone (tests/gpu/test_batched_vs_alone_cuda.py).
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-440}
mkdir -p /tmp/base && tar -C . --exclude=./.gpu --exclude=./.whl -cf - . | tar -C /tmp/base -xf -
cp .s33base/attention.py .s33base/cache.py /tmp/base/stages/models/deepseek_v4/
run write_test 90 python3 -m pytest -q -x tests/gpu/test_flash_mla_v4.py -k fused_v4
DEC="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8 --rows 1,16"
for round in 1 2; do
  run "decode_tree_$round" 80 $DEC --out "$R/decode_tree_$round.json"
  run "decode_base_$round" 80 env PYTHONPATH=/tmp/site:/tmp/base bash -c "cd /tmp/base && $DEC --out $R/decode_base_$round.json"
done
run batched_fp8 150 python3 -m pytest -q -x tests/gpu/test_batched_vs_alone_cuda.py -k "v4 and fp8"
grep -h "ms_per_step\|passed\|failed\|error" $R/*.log | cut -c1-300 | head -30
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

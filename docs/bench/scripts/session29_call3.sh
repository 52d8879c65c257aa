#!/usr/bin/env bash
# Session 29, call 3 (one GPU, an H200 if it comes; carry .gpu, .whl/sgl_flash_mla-*.whl, .tfw,
# .commit): the revised hyper-connection merge test; the last 8K chunk of 256K by groups with
# the host's view (how long the forward takes to return, where it synchronises); the activation
# quantizers' launches; Nsight Compute on the one-row MoE's two kernels (where ncu exists and may
# read the counters); then the V4-Flash rows of record still missing at this tree: the decode
# step in graphs at 1-512 rows in bf16 and FP8, the bf16 TTFT rows (FP8 against bf16 at 256K),
# the bf16 512-row decode row; with time left, the chunk with plain launches and the engine's
# FP8 ITL at 1-256 rows.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=${DEADLINE:-420}
CASE=deepseek-v4-flash:8:262144:8192:512:512
LIMIT=60 step merge python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_triton_hyper.py -k merge
LIMIT=60 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --out "$R/breakdown_fp8.json"
LIMIT=45 step act_quantizers python3 -m app.bench.fp8 --act-quantizers --out "$R/act_quantizers.json"
LIMIT=60 step ncu_moe bash -c 'NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu: $NCU"; [ -n "$NCU" ] && $NCU -k regex:_grouped_w8a8 --launch-skip 4 --launch-count 2 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats python3 docs/bench/scripts/ncu_moe_one_row.py'
LIMIT=60 step v4_decode_bf16 python3 -m app.bench.v4_decode --context 512 \
  --rows 1,16,64,256,512 --out "$R/v4_decode_bf16.json"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,64,256,512 --out "$R/v4_decode_fp8.json"
left=$((D - SECONDS))
[ $left -gt 100 ] && LIMIT=$((left > 130 ? 120 : left - 10)) step ttft-v4-flash \
  python3 -m app.cli bench suite --only ttft-v4-flash --device cuda --timeout 115 --out "$R/suite"
left=$((D - SECONDS))
[ $left -gt 80 ] && LIMIT=75 step decode-v4-flash-512 python3 -m app.cli bench suite \
  --only decode-v4-flash-512 --device cuda --timeout 70 --out "$R/suite"
left=$((D - SECONDS))
[ $left -gt 40 ] && LIMIT=35 step breakdown_fp8_nopdl python3 -m app.bench.deepseek_breakdown \
  --linear auto --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --no-pdl \
  --out "$R/breakdown_fp8_nopdl.json"
left=$((D - SECONDS))
[ $left -gt 85 ] && LIMIT=$((left - 5)) step decode-v4-flash-itl-fp8 python3 -m app.cli bench \
  suite --only decode-v4-flash-itl-fp8 --device cuda --timeout $((left - 10)) --out "$R/suite"
grep -h "^| " $R/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"  # one file back (a call returns a few files only)

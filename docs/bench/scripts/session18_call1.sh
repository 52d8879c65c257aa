#!/usr/bin/env bash
# Session 18, call 1 (one H200; carry .gpu
# .whl .tfw .commit): session 17's kernels, written with
# no device, against their references, then timed beside what they replace:
# - GPU tests: the FP8 MoE's gate/up GEMM with the SwiGLU and quantizer in its epilogue
#   (bit-equality with the unfused path; the whole MoE against fp8_ref), the W8A8 linears (the
#   GEMV of 1-4 rows among them) and the swiglu GEMV, route_topk's appended shared-expert pick,
#   group_pool skipping groups that do not complete, the rule's top-k in one program, the
#   indexer top-k;
# - `app.bench.fp8 --moe-swiglu` (fused against unfused at 1/64/512/8192 tokens),
#   `app.bench.indexer_select` (the rule's kernel against torch's top-k on the candidates),
#   `app.bench.fp8 --decode-linears` (the GEMV against cuBLASLt per V4 linear), hc_mix's finish
#   kernel at 1-16 warps (docs/bench/scripts/hc_finish_warps.py);
# - the V4 decode stage in graphs, FP8 with the defaults and with the shared expert beside the
#   stack (--shared-expert beside), and bf16 (1 and 512 rows);
# - the last 8K chunk of 256K by kernel group (FP8 weights + FP8 KV).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
LIMIT=110 step kernel_tests $GPU_PYTEST "${KERNEL_TESTS[@]}"
LIMIT=50 step moe_swiglu python3 -m app.bench.fp8 --moe-swiglu --out "$R/moe_swiglu.json"
LIMIT=60 step rule_topk python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x1:2304,512x1:2304,1x8192:262144 --out "$R/indexer_select.json"
LIMIT=40 step decode_linears python3 -m app.bench.fp8 --decode-linears --out "$R/decode_linears.json"
LIMIT=30 step hc_finish_warps python3 docs/bench/scripts/hc_finish_warps.py "$R/hc_finish_warps.json"
V4="python3 -m app.bench.v4_decode --context 512 --quantization fp8 --kv-cache-dtype fp8"
LIMIT=60 step v4_decode_fp8 $V4 --rows 1,64,512 --out "$R/v4_decode_fp8.json"
LIMIT=50 step v4_decode_fp8_beside $V4 --rows 1,64,512 --shared-expert beside --out "$R/v4_decode_fp8_beside.json"
LIMIT=60 step breakdown_fp8 python3 -m app.bench.deepseek_breakdown --linear auto --quantization fp8 \
  --kv-cache-dtype fp8 --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8.json"
left=$((570 - SECONDS)); LIMIT=$((left < 45 ? left : 45)) step v4_decode_bf16 \
  python3 -m app.bench.v4_decode --rows 1,512 --context 512 --out "$R/v4_decode_bf16.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

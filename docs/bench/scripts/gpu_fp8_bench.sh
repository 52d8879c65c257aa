#!/usr/bin/env bash
# One H200, issue 24: the FP8 kernels' GPU tests after they moved onto the shared layout and
# K loop (beside them, while it starts: `ppserve serve --quantization fp8 --kv-cache-dtype fp8`
# on a 4-layer V3.2-bench model, answering one /v1/completions over real HTTP), then the
# V3.2-bench model (PP=1) with FP8 weights + FP8 KV against bf16: TTFT at 64K and 128K
# (`--linear auto`: cuBLAS / cuBLASLt block-scaled FP8 linears, grouped Triton MoE), decode tok/s
# at 512 rows and the KV capacity the engine sizes from memory. Carry .gpu (Ray) and the
# sgl-flash-mla wheel; run from the repo root with PYTHONPATH set. Logs and JSON under $OUT.
#   SERVE_DEVICE=cpu bash docs/bench/scripts/gpu_fp8_bench.sh   (the serve step alone, on CPU)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEVICE=${SERVE_DEVICE:-cuda}
SHAPE=${SERVE_SHAPE:-deepseek-v32-bench}
MODEL=$(python3 -c "from app.bench.target import write_model; print(write_model('$SHAPE', 4)[0])")
DTYPE=bfloat16; FP8="--quantization fp8 --kv-cache-dtype fp8"
[ "$DEVICE" = cpu ] && DTYPE=float32 && FP8=""
python3 -m app.cli serve --model "$MODEL" --load-format dummy --served-model-name v32 \
    --pp 1 --device "$DEVICE" --dtype "$DTYPE" $FP8 --max-model-len 4096 \
    --num-gpu-blocks-override 128 --port 8000 > "$OUT/serve_fp8.log" 2>&1 &
server=$!
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
  timeout 80 python3 -m pytest -q -m gpu tests/gpu/test_fp8_kernels.py \
      tests/gpu/test_mla_moe_kernels.py tests/gpu/test_triton_gemm.py \
      -k "fp8 or w8a8 or experts or triton_moe or 4097 or 515 or bias or batched" \
      -p no:cacheprovider -rf 2>&1 | tail -30 | tee "$OUT/gpu_fp8b_tests.log"
fi
ok=""
for _ in $(seq 90); do curl -sf 127.0.0.1:8000/health > /dev/null && ok=1 && break; sleep 1; done
python3 - > "$OUT/serve_fp8_request.log" 2>&1 <<'PY'
import json, urllib.error, urllib.request
body = {"model": "v32", "prompt": [100 + i for i in range(40)], "max_tokens": 8,
        "temperature": 0}
req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.load(r)
except urllib.error.HTTPError as e:
    raise SystemExit(f"HTTP {e.code}: {e.read().decode()}")
print(json.dumps(out, indent=1))
print("completion tokens:", out["usage"]["completion_tokens"])
PY
rc=$?
echo "health: ${ok:-no}; request rc $rc" | tee -a "$OUT/serve_fp8_request.log"
tail -3 "$OUT/serve_fp8_request.log"
kill -INT $server; wait $server
[ "$DEVICE" = cuda ] || exit 0
B="python3 -m app.bench.engine --model-shape deepseek-v32-bench --pp 1 --linear auto"
B="$B --runs 65536:4096,131072:8192 --modes auto --reps 1"
L="python3 -m app.bench.load --model-shape deepseek-v32-bench --pp 1 --device cuda --parts decode"
L="$L --decode-concurrency 512 --decode-tokens 16 --reps 1 --decode-modes auto --run-ahead"
L="$L --no-reference --kv-blocks memory"
run() {  # name timeout command...: the full log under $OUT, its last lines here
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name rc $?"; grep -v "^(" "$OUT/$name.log" | grep "loaded\|TTFT\|tok/s\|Error" | tail -4
}
run v32_fp8_ttft 110 $B $FP8
run v32_fp8_decode_512 50 $L $FP8
run v32_bf16_decode_512 50 $L
run v32_bf16_ttft 100 $B

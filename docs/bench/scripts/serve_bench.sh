#!/usr/bin/env bash
# Issue 4 item 3g: `ppserve bench serve` against a real endpoint, once per skip mode.
# For each mode: start `ppserve serve` (Llama-3-8B-shaped random weights, PP=2), wait for
# /health, run the load client at two request rates (with the server's skip counters), stop the
# server (SIGINT: it shuts its own Ray cluster down).
#   bash docs/bench/scripts/serve_bench.sh OUT_DIR [modes] [extra bench-serve args...]
# Env: DEVICE (cuda), LAYERS (32), PP (2), HIDDEN (4096): small values give a CPU smoke run.
set -u
OUT=${1:?output folder}; MODES=${2:-auto,off}; shift; shift || true
DEVICE=${DEVICE:-cuda}; LAYERS=${LAYERS:-32}; PP=${PP:-2}; HIDDEN=${HIDDEN:-4096}
MODEL=$(mktemp -d /tmp/ppserve-l8b-XXXX)
python3 - "$MODEL" "$LAYERS" "$HIDDEN" <<'PY'
import json, sys
from app.bench.target import LLAMA3_8B
cfg = dict(LLAMA3_8B, num_hidden_layers=int(sys.argv[2]))
if int(sys.argv[3]) != 4096:  # smoke runs: same heads layout, narrower
    h = int(sys.argv[3]); cfg.update(hidden_size=h, intermediate_size=2 * h, head_dim=h // 32)
json.dump(cfg, open(sys.argv[1] + "/config.json", "w"))
PY
DTYPE=bfloat16; [ "$DEVICE" = cpu ] && DTYPE=float32
for mode in ${MODES//,/ }; do
  python3 -m app.cli serve --model "$MODEL" --load-format dummy --served-model-name l8b \
    --pp "$PP" --device "$DEVICE" --dtype "$DTYPE" --chunk-size 4096 --max-model-len 40000 \
    --pp-output-skip "$mode" --port 8000 > "$OUT/serve_$mode.log" 2>&1 &
  server=$!
  for _ in $(seq 180); do
    curl -sf 127.0.0.1:8000/health > /dev/null && break; sleep 1
  done
  python3 -m app.cli bench serve --model l8b --token-id-min 1000 --token-id-max 120000 \
    --metrics-url http://127.0.0.1:8080/metrics \
    --out "$OUT/serve_$mode.json" "$@" 2>&1 | tee "$OUT/bench_serve_$mode.log"
  kill -INT $server; wait $server
  sleep 2  # let the port go before the next mode
done

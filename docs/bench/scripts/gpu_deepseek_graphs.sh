#!/usr/bin/env bash
# One H200, issue 23 item 3: the DeepSeek decode-graph GPU tests (and the Llama ones: the same
# DecodeGraphs), then V3.2-bench and V2-Lite decode at 512 rows with graphs (this tree) and,
# with BEFORE=dir, the same benches from another checkout (main, eager). Needs Ray and the
# sgl-flash-mla wheel on PYTHONPATH. Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bench() {  # name shape [dir]
    (cd "${3:-.}" && PYTHONPATH=/tmp/site:$PWD timeout "${T:-170}" python3 -m app.bench.load --model-shape "$2" --pp 1 \
        --device cuda --parts decode --decode-concurrency 512 --decode-tokens 16 --reps 1 \
        --decode-modes auto --run-ahead --out "$OUT/$1.json") 2>&1 | grep -v "^(raylet)" \
        | tail -8 | tee "$OUT/$1.log"
}
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_deepseek_decode_graphs.py \
        tests/gpu/test_decode_graphs.py -p no:cacheprovider 2>&1 | tail -30 \
        | tee "$OUT/gpu_tests_deepseek_graphs.log"
fi
for s in ${SHAPES:-deepseek-v32-bench deepseek-v2-lite}; do bench "${s}_decode_512_graphs" "$s"; done
if [ -n "${BEFORE:-}" ]; then
    for s in ${BEFORE_SHAPES:-${SHAPES:-deepseek-v32-bench deepseek-v2-lite}}; do
        bench "${s}_decode_512_main" "$s" "$BEFORE"
    done
fi

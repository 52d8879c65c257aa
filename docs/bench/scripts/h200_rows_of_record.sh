#!/usr/bin/env bash
# The H200 rows of record for issues 34 / 35, two calls (carry .gpu, .whl, .commit,
# .gpu-deepgemm; .gpu's Ray stripped by strip_raysite.sh, else the carry passes 64 MiB):
#   bash docs/bench/scripts/h200_rows_of_record.sh decode   # then, warm, within 30 s:
#   bash docs/bench/scripts/h200_rows_of_record.sh ttft
# (`v4rows`: the V4-Flash decode steps, FP8 then bf16; `v4engine`: the engine's bf16 rows.
# Several parts in one call run in turn: `h200_rows_of_record.sh v4rows v4engine`.)
# decode: the V4-Flash decode steps in graphs (FP8 and bf16 at 1/16/512 rows: the bf16 stage
# does not fit an H100), the decode linear's shapes against cuBLASLt, DeepGEMM built, the FP8
# TTFT rows at 64K-256K through the suite with its grouped GEMMs in the MoE. ttft: the 512K and
# 1,040,384-token rows the same way, the 256K last chunk by groups (DeepGEMM's MoE), then the
# suite's decode rows of the other models (V3.2-bench at 512 rows, Llama-8B at 64; issue 34's
# "no slower" A/B is no_slower_ab.sh). Each step only while time is left.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEADLINE=${DEADLINE:-575}
SUITE="python3 -m app.cli bench suite --device cuda --out $R/suite"
DEC="python3 -m app.bench.v4_decode --context 512 --rows 1,16,512"
for PART in "${@:-decode}"; do
case "$PART" in
  v4rows)
    run v4_decode_fp8 100 $DEC --quantization fp8 --kv-cache-dtype fp8 \
      --out "$R/v4_decode_fp8.json"
    run v4_decode_bf16 80 $DEC --out "$R/v4_decode_bf16.json" ;;
  v4engine)
    run engine_v4_bf16_512 200 $SUITE --only decode-v4-flash-512 --timeout 190
    run engine_v4_bf16_itl 150 $SUITE --only decode-v4-flash-itl --timeout 140 ;;
  decode)
    run v4_decode_fp8 100 $DEC --quantization fp8 --kv-cache-dtype fp8 \
      --out "$R/v4_decode_fp8.json"
    run v4_decode_bf16 80 $DEC --out "$R/v4_decode_bf16.json"
    run decode_linear 40 python3 -m app.bench.fp8_decode_linear --rows 1,16 \
      --out "$R/decode_linear.json"
    use_deepgemm 110
    run ttft_fp8_deepgemm 160 /tmp/with_dg $SUITE --only ttft-v4-flash-fp8 --timeout 150 ;;
  ttft)
    use_deepgemm 110
    run ttft_1m_fp8_deepgemm 240 /tmp/with_dg $SUITE --only ttft-v4-flash-1m-fp8 --timeout 230
    run breakdown_fp8_deepgemm 70 /tmp/with_dg python3 -m app.bench.deepseek_breakdown \
      --linear auto --quantization fp8 --kv-cache-dtype fp8 \
      --cases deepseek-v4-flash:8:262144:8192:512:512 --out "$R/breakdown_fp8_dg.json"
    run decode_others 200 $SUITE --only decode-v32-512,decode-llama8b-64 --timeout 190 ;;
esac
grep -ih "ttft\|error\|Traceback\|ms a step\|tok/s" $R/*.log | cut -c1-240 | head -40
tar czf "$OUT/rows_$PART.tgz" -C "$OUT" r && rm -rf "$R" && mkdir -p "$R"
done

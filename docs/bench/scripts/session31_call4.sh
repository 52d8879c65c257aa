#!/usr/bin/env bash
# Session 31, call 4 (one H200; carry .whl/sgl_flash_mla-*.whl, .tfw, .commit, .gpu-deepgemm;
# call 5 brings Ray): DeepGEMM built, the deepgemm MoE's GPU tests (the routing kernels now
# write its m_indices); V4-Flash decode in graphs at this tree, FP8 (weights + KV)
# and bf16 (the 8-layer bf16 stage does not fit an H100), for issue 34's rows of record; the 256K
# last chunk by groups with DeepGEMM's grouped GEMMs in the MoE and without.
set -u
. docs/bench/scripts/host_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT=120 step build_dg env DG_CXX=/usr/bin/g++ bash .gpu-deepgemm/deepgemm_build.sh \
  .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg
printf '#!/usr/bin/env bash\n. /tmp/dg/env.sh && export DG_JIT_DEBUG=0 DG_JIT_PRINT_COMPILER_COMMAND=0 && exec "$@"\n' > /tmp/with_dg
chmod +x /tmp/with_dg
LIMIT=90 step gpu_tests /tmp/with_dg python3 -m pytest -rA -q -m gpu -p no:cacheprovider \
  tests/gpu/test_deepgemm_moe_cuda.py tests/gpu/test_fp8_kernels.py -k "deepgemm or experts"
LIMIT=60 step v4_decode_fp8 python3 -m app.bench.v4_decode --context 512 --quantization fp8 \
  --kv-cache-dtype fp8 --rows 1,16,512 --out "$R/v4_decode_fp8.json"
LIMIT=90 step v4_decode_bf16 python3 -m app.bench.v4_decode --context 512 \
  --rows 1,16,64,256,512 --out "$R/v4_decode_bf16.json"
CASE=deepseek-v4-flash:8:262144:8192:512:512
LIMIT=75 step breakdown_deepgemm /tmp/with_dg python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --out "$R/breakdown_deepgemm.json"
LIMIT=75 step breakdown_triton python3 -m app.bench.deepseek_breakdown --linear auto \
  --quantization fp8 --kv-cache-dtype fp8 --cases $CASE --out "$R/breakdown_triton.json"
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"

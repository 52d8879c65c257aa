#!/usr/bin/env bash
# Session 22, a short first call (one H100 or H200; carry .gpu .whl .tfw .commit): the two Gluon
# kernels session 21 built without a device, before anything else spends device time on them.
# Their GPU tests (the Triton kernels' bits), then their times beside the Triton kernels': the
# MoE's grouped GEMM at V4-Flash's 8K-token chunk (the tile sweep's "gluon" rows) and the
# indexer's chunk scores at the last 8K chunk of a 256K prompt (`logits_fp8_gluon_ms`). About
# 3 minutes. If both are equal and faster: flip triton_moe_fp8.GLUON_FROM and
# triton_indexer.GLUON_CHUNKS, then session21_call4.sh (the FP8 TTFT rows).
set -u
. docs/bench/scripts/host_env.sh
. docs/bench/scripts/gpu_test_sets.sh
python3 -c "import triton; print('triton', triton.__version__)" | tee "$R/env.log"
LIMIT=90 step gluon_tests $GPU_PYTEST \
  tests/gpu/test_fp8_kernels.py::test_gluon_grouped_gemm_equals_the_triton_one \
  tests/gpu/test_indexer_kernel.py::test_gluon_chunk_scores_equal_the_triton_kernel
LIMIT=60 step moe_tiles python3 -m app.bench.fp8 --moe-tiles --out "$R/moe_tiles.json"
LIMIT=60 step indexer python3 -m app.bench.indexer_select --topk 512 --no-loop --rate 4 \
  --cases 1x8192:262144,1x2048:65536 --out "$R/indexer_select.json"
tar czf "$OUT/results.tgz" -C "$OUT" r

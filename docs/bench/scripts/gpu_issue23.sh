# The device runs of issue 23 (one H200), from the repository root. Runs 1-3 as made; run 4
# (the GPU tests of the indexer and the cuDNN MLA dims, the indexer bench on ebd7543's kernels,
# the MoE sweep with flatten / warp-specialized variants) was written but not run: no device
# time was left.
set -o pipefail
# run 1
python3 -m pytest tests/gpu/test_mla_moe_kernels.py -k triton_moe -q -x -m gpu
python3 -m app.bench.mla_attention --out docs/bench/mla_attention.json  # log: mla_attention.log
# run 2 (old kernel: HEAD~'s stages/kernels/triton_moe.py saved as old_triton_moe.py)
python3 -m app.bench.moe --tune --before old_triton_moe.py --out docs/bench/moe_kernels.json
# run 3
python3 -m app.bench.indexer_select --cases 512x1:32768,1x4096:32768 --out docs/bench/indexer_select.json
python3 -m app.bench.mla_attention --only cudnn_split_v128,sdpa_vpad --cases 4096:131072:128 \
    --out docs/bench/mla_attention_128h.json
python3 -m app.bench.deepseek_breakdown --out docs/bench/deepseek_breakdown.json
# run 4 (not run)
python3 -m pytest -m gpu -q tests/gpu/test_indexer_kernel.py tests/gpu/test_mla_moe_kernels.py \
    "tests/gpu/test_cudnn_attention.py::test_mla_head_dims_match_reference"
python3 -m app.bench.moe --tune --out docs/bench/moe_kernels_flatten.json

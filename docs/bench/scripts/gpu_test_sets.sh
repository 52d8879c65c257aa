# Sourced by session 18's device scripts: the GPU test sets they share, one definition each.
# KERNEL_TESTS: session 17's kernels against their references (the fused SwiGLU epilogue, the W8A8
# linears and GEMV, route_topk's shared-expert pick, group_pool, the rule's top-k, the indexer);
# GRAPH_TESTS: V4's and V3.2's decode graphs (graphed == eager == the general path, the engine's
# graphed tokens == --enforce-eager's).
F=tests/gpu/test_fp8_kernels.py
KERNEL_TESTS=(
  $F::test_fused_gate_up_swiglu_equals_the_unfused_path $F::test_fp8_experts_match_reference
  $F::test_w8a8_linear_matches_reference $F::test_swiglu_down_projection_equals_the_unfused_one
  $F::test_v4_stage_fp8_against_bf16 tests/gpu/test_route_topk_cuda.py
  tests/gpu/test_group_pool_cuda.py tests/gpu/test_rule_topk_cuda.py tests/gpu/test_indexer_kernel.py
)
GRAPH_TESTS=(tests/gpu/test_deepseek_v4_decode_graphs.py tests/gpu/test_deepseek_decode_graphs.py)
GPU_PYTEST="python3 -m pytest -rA -q -m gpu -p no:cacheprovider"

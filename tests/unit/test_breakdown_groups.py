"""The kernel-name groups of the DeepSeek breakdown's profiles (app.bench.deepseek_breakdown):
each kernel a group the breakdown tables name, the first matching substring winning."""

from __future__ import annotations

import pytest

from app.bench.deepseek_breakdown import group_of


@pytest.mark.parametrize(
    "kernel,group",
    [
        ("_grouped_w8a8", "moe (FP8)"),
        ("_grouped_w8a8_swiglu", "moe (FP8)"),  # the quantizer in its epilogue is the MoE's
        ("_count_plan", "moe routing"),
        ("_plan", "moe routing"),
        ("_rule_top_k", "top-k (Triton)"),
        ("compact_kernel", "top-k (Triton)"),
        ("_quantize_1x128", "fp8 activation quantizer"),
        ("_swiglu_quantize_1x128", "fp8 activation quantizer"),
        ("void at::native::sbtopk::gatherTopK<float>", "top-k"),
        ("nvjet_sm90_qqtst_128x128", "gemm (cuBLAS)"),
        ("some_new_kernel", "other"),
    ],
)
def test_kernels_fall_in_their_groups(kernel, group):
    assert group_of(kernel) == group

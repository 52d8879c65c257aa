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


def test_expert_loads_of_a_routing():
    """A chunk's routing by experts: touched, busiest, mean over all routed experts and their
    spread; a shared slot's column (id == experts) left out."""
    import torch

    from app.bench.moe import expert_loads

    even = torch.arange(8).view(4, 2)  # 4 tokens x top-2 over 8 experts: one row each
    assert expert_loads(even, 8) == {"touched": 8, "max_rows": 1, "mean_rows": 1.0, "cv": 0.0}
    skewed = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 8]])  # 8: a shared slot
    loads = expert_loads(skewed, 4)
    assert (loads["touched"], loads["max_rows"], loads["mean_rows"]) == (3, 4, 1.75)
    assert loads["cv"] == round(float(torch.tensor([4.0, 2, 1, 0]).std(unbiased=False)) / 1.75, 3)

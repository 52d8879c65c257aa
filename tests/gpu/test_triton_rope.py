"""The rope_tail op's Triton kernel (stages/kernels/triton_rope.py) against its torch form
(stages/kernels/rope_tail.py) on CUDA, at DeepSeek-V4-Flash's shapes: the rotation alone the same
bits; after the queries' unweighted norm or V4RMSNorm's weighted one, within one bf16 unit where
the sum of squares' order tips a rounding; and captured in a CUDA graph, the same as eager. Also
rms_norm_fp32, V4RMSNorm's norm alone, against torch's."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import rope_tail as torch_form
from stages.kernels import triton_rope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# (x's shape, rotated channels): queries / outputs, the indexer's queries, the latent; one row
SHAPES = [((8192, 64, 512), 64), ((333, 64, 128), 64), ((1000, 512), 64), ((1, 64, 512), 64)]


def _inputs(shape: tuple[int, ...], r: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(shape, generator=g, device="cuda") * 3).bfloat16()
    theta = torch.rand(shape[0], r // 2, generator=g, device="cuda") * 6.3
    cos, sin = theta.cos().bfloat16().float(), theta.sin().bfloat16().float()
    return x, cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


@pytest.mark.parametrize("shape,r", SHAPES)
@pytest.mark.parametrize("norm", ["none", "unweighted", "weighted"])
def test_kernel_matches_the_torch_form(shape, r, norm):
    x, cos, sin = _inputs(shape, r, seed=r + len(shape))
    eps = None if norm == "none" else 1e-6
    weight = None
    if norm == "weighted":  # V4RMSNorm's fp32 weight
        weight = torch.rand(shape[-1], device="cuda") + 0.5
    want = torch_form.rope_tail(x.clone(), cos, sin, eps, weight)
    got = triton_rope.rope_tail(x, cos, sin, eps, weight)
    assert got.data_ptr() == x.data_ptr()
    if norm == "none":
        assert torch.equal(got, want)
        return
    # a bf16 rounding of the normed head that the sum's order tipped moves a rotated channel by
    # up to one unit of its inputs (so an atol: a rotation can cancel to near zero)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-4)
    assert (got != want).float().mean().item() < 1e-4


def test_kernel_in_a_cuda_graph_equals_eager():
    x, cos, sin = _inputs((64, 64, 512), 64, seed=9)
    eager = triton_rope.rope_tail(x.clone(), cos, sin, 1e-6)
    static = x.clone()
    triton_rope.rope_tail(static.clone(), cos, sin, 1e-6)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_rope.rope_tail(static, cos, sin, 1e-6)
    static.copy_(x)
    graph.replay()
    assert torch.equal(static, eager)


@pytest.mark.parametrize("shape", [(8192, 4096), (1, 4096), (512, 1024), (3, 2, 512)])
def test_rms_norm_matches_the_torch_form(shape):
    """rms_norm_fp32 (V4RMSNorm) on Triton against fp32_rms_norm (torch's fused rms_norm over
    fp32): within one bf16 unit where the sum's order tips a rounding."""
    g = torch.Generator(device="cuda").manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g, device="cuda") * 3).bfloat16()
    weight = torch.rand(shape[-1], generator=g, device="cuda") + 0.5
    want = torch_form.fp32_rms_norm(x, weight, 1e-6)
    got = triton_rope.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    assert (got != want).float().mean().item() < 1e-3


@pytest.mark.parametrize("n", [1, 512, 8192])
def test_angles_match_the_torch_form(n):
    """rope_angles on CUDA: cosf / sinf as torch's, the same bf16 roundings: the same values
    (a rounding apart at most, rarely)."""
    positions = torch.randint(0, 1 << 20, (n,), device="cuda")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).cuda()
    want = torch_form.rope_angles(positions, inv_freq, 0.75, torch.bfloat16)
    got = triton_rope.rope_angles(positions, inv_freq, 0.75, torch.bfloat16)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=0)
        assert (a != b).float().mean() < 1e-3

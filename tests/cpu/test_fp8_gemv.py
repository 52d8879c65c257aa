"""The W8A8 GEMV of a few rows (stages/kernels/triton_fp8_gemv.py) under Triton's interpreter
against fp8_ref.linear (the activations quantized in 1 x 128 groups, the weights dequantized
by their 128 x 128 blocks, fp32 sums): one to four rows of very different magnitudes (an
all-zero one), N off the 16 and 128 grids, a bias; K off the 128 grid and five rows refused."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_ref

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (3, 200, 384), (4, 1040, 256), (2, 16, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_interpreted_gemv_is_the_w8a8_reference(triton_interpreter, m, n, k, bias):
    from stages.kernels import triton_fp8_gemv

    g = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).half()
    x[m // 2, : k // 2] = 0  # a zero group: the scale's floor
    w, s = fp8_ref.quantize_weight(torch.randn(n, k, generator=g) / 10)
    b = torch.randn(n, generator=g).half() if bias else None
    got = triton_fp8_gemv.linear(x, w, s, b)
    want = fp8_ref.linear(x, w, s, b)
    assert got.shape == (m, n) and got.dtype == x.dtype
    # the same products of the same e4m3 values; only the fp32 sums' order differs
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("m", [1, 3])
def test_interpreted_swiglu_gemv_is_the_down_projection_of_the_swiglu(triton_interpreter, m, limit):
    """The fp8_swiglu_linear contract (a SwiGLU's down projection fed gate | up): the swiglu's
    steps before the quantizer, in the kernel; the clamp reached at these values."""
    from stages.kernels import triton_fp8_gemv

    g = torch.Generator().manual_seed(m)
    gate_up = (torch.randn(m, 512, generator=g) * 2).half()
    w, s = fp8_ref.quantize_weight(torch.randn(96, 256, generator=g) / 10)
    got = triton_fp8_gemv.swiglu_linear(gate_up, limit, w, s)
    want = fp8_ref.swiglu_linear(gate_up, limit, w, s)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-3)
    if limit is not None:
        assert bool((gate_up.abs() > limit).any())


def test_shapes_it_does_not_take_are_refused():
    from stages.kernels import triton_fp8_gemv

    assert triton_fp8_gemv.takes(1, 300, 4096) and triton_fp8_gemv.takes(4, 16, 128)
    assert not triton_fp8_gemv.takes(5, 300, 4096)  # a batch: the GEMMs'
    assert not triton_fp8_gemv.takes(1, 300, 200)  # K off the 128 grid
    w, s = fp8_ref.quantize_weight(torch.randn(64, 256))
    with pytest.raises(ValueError, match="1 to 4 rows"):
        triton_fp8_gemv.linear(torch.randn(5, 256), w, s)

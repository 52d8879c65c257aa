"""The W8A8 linear of a decode step's rows on the tensor cores (stages/kernels/
triton_fp8_decode_linear.py) under Triton's interpreter: against fp8_ref.linear (the activations
quantized in 1 x 128 groups, the weights dequantized by their 128 x 128 blocks, fp32 sums), one
to 32 rows of very different magnitudes (an all-zero group), N off the 64 and 128 grids, a bias;
a row's bits the same in any batch; K off the 128 grid and 33 rows refused."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_ref

pytestmark = pytest.mark.interpreter


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).bfloat16()
    x[m // 2, : k // 2] = 0  # a zero group: the scale's floor
    w, s = fp8_ref.quantize_weight(torch.randn(n, k, generator=g) / 10)
    return x, w, s


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (3, 200, 384), (17, 1040, 256), (32, 64, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_interpreted_decode_linear_is_the_w8a8_reference(triton_interpreter, m, n, k, bias):
    from stages.kernels import triton_fp8_decode_linear

    x, w, s = _operands(m, n, k, m * n + k)
    b = torch.randn(n).bfloat16() if bias else None
    got = triton_fp8_decode_linear.linear(x, w, s, b)
    want = fp8_ref.linear(x, w, s, b)
    assert got.shape == (m, n) and got.dtype == x.dtype
    # the same products of the same e4m3 values; only the fp32 sums' order differs
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_interpreted_rows_keep_their_bits_in_any_batch(triton_interpreter):
    from stages.kernels import triton_fp8_decode_linear

    x, w, s = _operands(32, 384, 512, 7)
    batch = triton_fp8_decode_linear.linear(x, w, s)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 19)):
        assert torch.equal(triton_fp8_decode_linear.linear(x[rows], w, s), batch[rows])


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("m", [1, 5])
def test_interpreted_swiglu_decode_linear_is_the_down_projection(triton_interpreter, m, limit):
    """The fp8_swiglu_linear contract (a SwiGLU's down projection fed gate | up): the swiglu's
    steps before the quantizer, in the kernel; the clamp reached at these values."""
    from stages.kernels import triton_fp8_decode_linear

    g = torch.Generator().manual_seed(m)
    gate_up = (torch.randn(m, 512, generator=g) * 2).bfloat16()
    w, s = fp8_ref.quantize_weight(torch.randn(192, 256, generator=g) / 10)
    got = triton_fp8_decode_linear.swiglu_linear(gate_up, limit, w, s)
    want = fp8_ref.swiglu_linear(gate_up, limit, w, s)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    if limit is not None:
        assert bool((gate_up.abs() > limit).any())


def test_shapes_it_does_not_take_are_refused():
    from stages.kernels import triton_fp8_decode_linear as d

    assert d.takes(1, 300, 4096) and d.takes(d.DECODE_ROWS, 16, 128)
    assert not d.takes(d.DECODE_ROWS + 1, 300, 4096)  # a batch: the GEMMs'
    assert not d.takes(1, 300, 200)  # K off the 128 grid
    w, s = fp8_ref.quantize_weight(torch.randn(64, 256))
    with pytest.raises(ValueError, match="1 to 32 rows"):
        d.linear(torch.randn(d.DECODE_ROWS + 1, 256), w, s)

"""The W8A8 decode linear (stages/kernels/triton_fp8_decode_linear.py) on the device, at
V4-Flash's decode shapes: a row's bits are the same alone and in any batch it takes (1 to 32
rows), and equal the Triton block-scaled GEMM's for that row in a 512-row batch (the same
arithmetic on the same instruction: the K steps' products promoted in K order); near the
fp8_ref reference. Whether cuBLASLt's rows equal them is measured, not asserted
(`python -m app.bench.fp8_decode_linear`, docs/PERFORMANCE.md)."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_gemm, fp8_ref, triton_fp8_decode_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fp8_gemm.is_available("cuda"), reason="needs triton on SM90+"),
]

# (N, K): x_proj (an HCA layer's), q_b, o_b, the indexer's q_b, an N off the 64 grid
SHAPES = [(2560, 4096), (32768, 1024), (4096, 8192), (8192, 1024), (576, 7168)]


def operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(512, k, generator=g, device="cuda").bfloat16()
    x[3, : k // 2] = 0  # a zero group: the scale's floor
    w = torch.randn(n, k, generator=g, device="cuda")
    wq, ws = fp8_ref.quantize_weight(w * torch.logspace(-2, 0, n, device="cuda")[:, None])
    return x, wq, ws


@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_keep_their_bits_in_every_batch(n, k):
    x, wq, ws = operands(n, k, n + k)
    batched = fp8_gemm.linear(x, wq, ws)  # the Triton block-scaled GEMM, 512 rows
    for rows in (1, 2, 16, 17, 32):
        got = triton_fp8_decode_linear.linear(x[:rows], wq, ws)
        assert torch.equal(got, batched[:rows]), (rows, (got - batched[:rows]).abs().max())
    ref = fp8_ref.linear(x[:32].float(), wq, ws)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("limit", [None, 10.0])
def test_swiglu_rows_equal_the_unfused_linear(limit):
    """The down projection fed gate | up: the swiglu's steps before the in-kernel quantizer give
    the bits of the linear of torch_ref.swiglu's output."""
    from stages.kernels import torch_ref

    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = (torch.randn(32, 2 * 2048, generator=g, device="cuda") * 6).bfloat16()
    wq = (torch.randn(4096, 2048, generator=g, device="cuda") * 0.05).to(fp8_ref.FP8)
    ws = torch.rand(32, 16, generator=g, device="cuda") + 0.5
    h = torch_ref.swiglu(gate_up[:, :2048], gate_up[:, 2048:], limit)
    for rows in (1, 32):
        got = triton_fp8_decode_linear.swiglu_linear(gate_up[:rows], limit, wq, ws)
        assert torch.equal(got, triton_fp8_decode_linear.linear(h[:rows], wq, ws))

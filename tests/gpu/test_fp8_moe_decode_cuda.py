"""The decode step's FP8 experts with the weight rows as the MMA's wide side (stages/kernels/
triton_moe_fp8_decode.py, triton_moe_fp8's path below SWAPPED_BELOW tokens) on the device, at
V4-Flash's widths (hidden 4096, intermediate 2048, top-6 with the SwiGLU clamp): a token's
output has the same bits through them as through the 64-row tiles of the grouped kernels, and
as in a batch of 300 tokens (the grouped GEMM then the quantizer)."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_ref, triton_moe_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_moe_fp8.is_available("cuda"), reason="needs triton on SM90+"),
]

EXPERTS, HIDDEN, INTER, TOP = 16, 4096, 2048, 6


def operands(tokens: int):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    gu = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda") / 30
    dn = torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") / 20
    (gq, gs), (dq, ds) = fp8_ref.quantize_weight(gu), fp8_ref.quantize_weight(dn)
    ids = torch.rand(tokens, EXPERTS, generator=g, device="cuda").topk(TOP, dim=-1).indices
    weights = torch.rand(tokens, TOP, generator=g, device="cuda")
    return x, gq, gs, dq, ds, ids, weights


def test_tokens_keep_their_bits_through_the_swapped_kernels(monkeypatch):
    x, gq, gs, dq, ds, ids, weights = operands(300)
    batch = triton_moe_fp8.moe_experts(x, gq, gs, dq, ds, ids, weights, limit=10.0)
    for tokens in (1, 5, 16, 63):
        args = (x[:tokens], gq, gs, dq, ds, ids[:tokens], weights[:tokens])
        got = triton_moe_fp8.moe_experts(*args, limit=10.0)
        assert torch.equal(got, batch[:tokens]), (tokens, (got - batch[:tokens]).abs().max())
        monkeypatch.setattr(triton_moe_fp8, "SWAPPED_BELOW", 0)  # the 64-row tiles
        tiled = triton_moe_fp8.moe_experts(*args, limit=10.0)
        monkeypatch.undo()
        assert torch.equal(got, tiled)
    ref = fp8_ref.moe_experts(x[:16], gq, gs, dq, ds, ids[:16], weights[:16], limit=10.0)
    assert ((batch[:16].float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2

"""The MXFP4 experts op (moe_experts_mxfp4): the torch reference equals torch_ref.moe_experts on
the dequantized weights; the W4A16 Triton kernel, run by Triton's CPU interpreter where triton
is installed (TRITON_INTERPRET=1), matches it to bf16/fp16 rounding on both of its paths
(tl.dot_scaled, and its own integer dequantizer + tl.dot), skipped picks (id -1, another rank's
experts) included; the registry picks it by auto."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import mxfp4, torch_ref


def _experts(experts: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    dn = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    return (*mxfp4.quantize(gu), *mxfp4.quantize(dn))


def _routes(tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("limit", [None, 0.05])
def test_reference_is_the_dequantized_experts(limit):
    gu, gus, dn, dns = _experts(4, 64, 32, 0)
    weights, ids = _routes(9, 4, 2, 1)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    got = mxfp4.moe_experts(x, gu, gus, dn, dns, ids, weights, limit=limit)
    want = torch_ref.moe_experts(
        x, mxfp4.dequantize(gu, gus), mxfp4.dequantize(dn, dns), ids, weights, limit
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_triton_backend_falls_back_on_cpu():
    from stages.kernels import triton_moe_mxfp4

    gu, gus, dn, dns = _experts(3, 32, 32, 3)
    weights, ids = _routes(5, 3, 2, 4)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(5))
    got = triton_moe_mxfp4.moe_experts(x, gu, gus, dn, dns, ids, weights)
    torch.testing.assert_close(got, mxfp4.moe_experts(x, gu, gus, dn, dns, ids, weights))
    assert triton_moe_mxfp4.tiles_for(6, 256).block_m == 16
    assert triton_moe_mxfp4.tiles_for(8192 * 6, 256).block_m == 128


def test_registry_selects_the_op():
    from stages.kernels.registry import PRIORITY, select_kernels

    assert PRIORITY["moe_experts_mxfp4"][0] == "triton-persistent"
    k = select_kernels("cpu")
    assert k.names["moe_experts_mxfp4"] == "torch" and k.moe_experts_mxfp4 is mxfp4.moe_experts


@pytest.mark.parametrize("dot_scaled", [True, False])
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,k,limit,block_k",
    [(37, 64, 64, 5, 2, None, 32), (20, 96, 32, 3, 3, None, 64), (37, 64, 64, 5, 2, 0.05, 64)],
)
def test_interpreted_kernel_matches_reference(
    triton_interpreter, tokens, hidden, inter, experts, k, limit, block_k, dot_scaled
):
    from stages.kernels import triton_moe_mxfp4 as moe

    gu, gus, dn, dns = _experts(experts, hidden, inter, tokens)
    weights, ids = _routes(tokens, experts, k, tokens + 1)
    # fp16: the interpreter's bf16 dot is wrong (raw bits); the GPU tests cover bf16
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(6)).half()
    tiles = moe.Mxfp4Tiles(16, 16, block_k, 1, 1, 2, dot_scaled)
    out = moe.run_moe(x, gu, gus, dn, dns, ids, weights, 3, tiles, limit)
    ref = mxfp4.moe_experts(x.float(), gu, gus, dn, dns, ids, weights, limit=limit)
    if limit is not None:  # the clamp bites: the test would pass without it otherwise
        unclamped = mxfp4.moe_experts(x.float(), gu, gus, dn, dns, ids, weights)
        assert ((unclamped - ref).norm() / ref.norm()).item() > 0.1
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize("dot_scaled", [True, False])
def test_interpreted_kernel_dequantizes_exactly(triton_interpreter, dot_scaled):
    """The down GEMM over one-hot rows (token t = unit vector t, weight 1) returns the
    dequantized weights' columns exactly: every code, scales 2^-3..2^3."""
    from stages.kernels import triton_moe_mxfp4 as moe

    hidden, inter = 48, 64
    g = torch.Generator().manual_seed(8)
    dn = torch.randint(0, 256, (1, hidden, inter // 2), generator=g, dtype=torch.uint8)
    dns = torch.randint(124, 131, (1, hidden, inter // 32), generator=g, dtype=torch.uint8)
    x = torch.eye(inter).half()
    ids, weights = torch.zeros(inter, 1, dtype=torch.long), torch.ones(inter, 1)
    r, a = moe.route_and_gather(x, ids, weights, 1, 16)
    tiles = moe.Mxfp4Tiles(16, 16, 32, 1, 1, 2, dot_scaled)
    y = moe.grouped_w4a16(a, dn, dns, r, 2, tiles, hidden, inter)
    want = mxfp4.dequantize(dn, dns)[0].T.half()
    torch.testing.assert_close(y, want, atol=0, rtol=0)


@pytest.mark.parametrize("dot_scaled", [True, False])
def test_interpreted_kernel_skips_picks(triton_interpreter, dot_scaled):
    """Tensor parallelism's -1 picks (experts another rank holds): the reference without them."""
    from stages.kernels import triton_moe_mxfp4 as moe

    tokens, hidden, inter, experts = 21, 64, 32, 4
    gu, gus, dn, dns = _experts(experts, hidden, inter, 9)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, hidden, generator=g).half()
    weights, ids = torch.randn(tokens, 6, generator=g).softmax(-1).topk(2, dim=-1)
    ids = ids.masked_fill(ids >= experts, -1)
    assert (ids < 0).any() and (ids >= 0).any()
    tiles = moe.Mxfp4Tiles(16, 16, 32, 1, 1, 2, dot_scaled)
    out = moe.run_moe(x, gu, gus, dn, dns, ids, weights, 3, tiles)
    ref = mxfp4.moe_experts(x.float(), gu, gus, dn, dns, ids, weights)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize("bf16", [True, False])
def test_interpreted_dequant_is_exact_over_the_scale_range(triton_interpreter, bf16):
    """The kernel's integer dequantizer (bf16 bits for bf16 activations, else fp32) equals
    mxfp4.dequantize bit for bit: every code, scale bytes 2..252."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    s = torch.randint(2, 253, (16, 4), generator=g, dtype=torch.uint8)
    out = torch.zeros(16, 128, dtype=torch.bfloat16 if bf16 else torch.float32)
    _store_dequantized[(1,)](w, s, out, 128, 16, 32, bf16)
    torch.testing.assert_close(out.float(), mxfp4.dequantize(w, s), atol=0, rtol=0)


try:
    import triton
    import triton.language as tl

    from stages.kernels.triton_moe_mxfp4 import _dequant
except ImportError:  # the interpreter tests skip
    triton = None

if triton is not None:

    @triton.jit
    def _store_dequantized(w, s, out, K, BN: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr):
        cols = tl.arange(0, BN).to(tl.int64)
        for k0 in range(0, K, BK):
            v = _dequant(w, s, cols, k0, K // 2, K // 32, K, BN, BK, BF16)
            ks = k0 + tl.arange(0, BK)
            tl.store(out + cols[:, None] * K + ks[None, :], v.to(out.dtype.element_ty))

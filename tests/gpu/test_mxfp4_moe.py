"""The MXFP4 grouped MoE (stages/kernels/triton_moe_mxfp4.py: packed e2m1 experts with e8m0
scales, dequantized in the kernel, bf16 MMA) on CUDA at V4-Flash's routed experts (256 of hidden
4096, width 2048, top-6; app/bench/target.py's shape): decode batches of 1, 64 and 512 rows and
an 8K-token prefill chunk, against the same experts dequantized (the bf16 grouped MoE on the
dequantized weights: the same math up to accumulation order; and mxfp4.moe_experts in fp32),
with V4's swiglu clamp, both grids, both upcast paths (tl.dot_scaled, the integer
dequantizer), and picks of id -1 (tensor parallelism's other rank)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stages.kernels import mxfp4, triton_moe, triton_moe_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
EXPERTS, TOP_K, HIDDEN, INTER = 256, 6, 4096, 2048
LIMIT = 10.0  # V4-Flash's swiglu_limit


@pytest.fixture(scope="module")
def experts():
    """Random codes (every nibble) and scales 2^-9..2^-6, packed and dequantized to bf16."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        u8 = dict(generator=g, device="cuda", dtype=torch.uint8)
        codes = torch.randint(0, 256, (EXPERTS, rows, cols // 2), **u8)
        scales = torch.randint(118, 122, (EXPERTS, rows, cols // 32), **u8)
        return codes, scales

    gu, gus = packed(2 * INTER, HIDDEN)
    dn, dns = packed(HIDDEN, INTER)
    wide = [
        torch.stack([mxfp4.dequantize(w[e], s[e]).bfloat16() for e in range(EXPERTS)])
        for w, s in ((gu, gus), (dn, dns))
    ]
    return (gu, gus, dn, dns), wide


def _batch(tokens: int, skip: bool = False):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    scores = torch.rand(tokens, EXPERTS, generator=g, device="cuda")
    weights, ids = scores.softmax(-1).topk(TOP_K, dim=-1)
    if skip:  # experts 128.. are another rank's
        ids = ids.masked_fill(ids >= EXPERTS // 2, -1)
    return x, ids, weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _own_dequant(x, gu, gus, dn, dns, ids, weights, limit=None):
    """The kernel on its integer dequantizer and tl.dot (the tiles' other path)."""
    from stages.kernels.triton_gemm import num_sms

    t, k = ids.shape
    tiles = replace(triton_moe_mxfp4.tiles_for(t * k, EXPERTS), dot_scaled=False)
    args = (x, gu, gus, dn, dns, ids, weights)
    return triton_moe_mxfp4.run_moe(*args, num_sms(x.device), tiles, limit)


@pytest.mark.parametrize("tokens", [1, 64, 512, 8192])
@pytest.mark.parametrize(
    "fn",
    [triton_moe_mxfp4.moe_experts, triton_moe_mxfp4.moe_experts_sm1, _own_dequant],
    ids=["dot-scaled", "dot-scaled-sm1", "own-dequant"],
)
def test_mxfp4_moe_matches_the_dequantized_experts(experts, tokens, fn):
    (gu, gus, dn, dns), (gu_wide, dn_wide) = experts
    x, ids, weights = _batch(tokens)
    got = fn(x, gu, gus, dn, dns, ids, weights, limit=LIMIT)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    same_math = triton_moe.moe_experts(x, gu_wide, dn_wide, ids, weights, limit=LIMIT)
    fp32 = mxfp4.moe_experts(x.float(), gu, gus, dn, dns, ids, weights, limit=LIMIT)
    assert rel(got, same_math) < 4e-3
    assert rel(got, fp32) < 1e-2


@pytest.mark.parametrize("tokens", [64, 8192])
def test_mxfp4_moe_skips_other_ranks_picks(experts, tokens):
    (gu, gus, dn, dns), _ = experts
    x, ids, weights = _batch(tokens, skip=True)
    assert (ids < 0).any() and (ids >= 0).any()
    got = triton_moe_mxfp4.moe_experts(x, gu, gus, dn, dns, ids, weights, limit=LIMIT)
    fp32 = mxfp4.moe_experts(x.float(), gu, gus, dn, dns, ids, weights, limit=LIMIT)
    assert rel(got, fp32) < 1e-2


def test_mxfp4_moe_runs_no_fallback(experts):
    """On the H200 the Triton backend runs (no fallback to the torch reference counted)."""
    from stages.kernels.fallbacks import FALLBACKS

    (gu, gus, dn, dns), _ = experts
    x, ids, weights = _batch(64)
    before = FALLBACKS.counts()
    triton_moe_mxfp4.moe_experts(x, gu, gus, dn, dns, ids, weights)
    assert FALLBACKS.counts() == before


def test_dot_scaled_builds_here(experts):
    """tl.dot_scaled builds on this GPU's Triton (else the kernel warns and takes its own
    dequantizer for good: the speed differs, the results do not)."""
    (gu, gus, dn, dns), _ = experts
    x, ids, weights = _batch(64)
    triton_moe_mxfp4.moe_experts(x, gu, gus, dn, dns, ids, weights)
    assert triton_moe_mxfp4._DOT_SCALED_BUILDS[0]

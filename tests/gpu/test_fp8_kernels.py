"""The FP8 kernels on CUDA against their torch references (fp32 math on the same quantized
inputs, so only accumulation order and the bf16 output differ): the W8A8 linears (scaled_mm with
block-wise scales, which hands (K / 128) % 4 != 0 to Triton: torch 2.11 refuses those scales;
the persistent Triton GEMM and its SMs - 1 grid), the FP8 experts, FlashMLA's sparse FP8 kernel
for prefill rows as well as decode rows, and a V3.2-shaped stage with FP8 weights and an FP8
latent cache against its bf16 twin, and a V4-shaped one likewise (FP8 experts under the swiglu
clamp, the 584-byte cache); the fused 1 x 128 activation quantizer against
fp8_ref.quantize_act, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from stages.kernels import (
    flash_mla,
    fp8_gemm,
    fp8_latent,
    fp8_ref,
    triton_fp8_act,
    triton_fp8_latent,
    triton_moe_fp8,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TOL = 1e-2
BACKENDS = {
    "decode-scaled-mm": fp8_gemm.linear_decode_scaled_mm,  # tensor cores up to 32 rows
    "scaled-mm": fp8_gemm.linear_scaled_mm,
    "triton-persistent": fp8_gemm.linear,
    "triton-persistent-sm1": fp8_gemm.linear_sm1,
}
# (M, N, K): V3.2's projections (q_a, q_b, o, shared expert down) and K / 128 = 11, 5, 3 (not
# multiples of 4), a ragged M and an N off the 128 grid (kv_a: 576)
SHAPES = [
    (512, 1536, 7168),
    (64, 24576, 1536),
    (300, 7168, 16384),
    (1, 7168, 2048),
    (256, 1024, 1408),
    (33, 2048, 640),
    (128, 512, 384),
    (200, 576, 7168),
    # a few decode rows, and an N off the 128 grid
    (16, 4096, 8192),
    (3, 1024, 4096),
    (1, 32768, 1024),
    (9, 576, 7168),
    # the decode linear's: two and four rows, V4's projections
    (2, 32768, 1024),
    (4, 4096, 8192),
]
# (M, K) of the activation quantizer: ragged M; K on the 128 grid, and off it (448, 200)
QUANT_SHAPES = [(1, 128), (37, 7168), (300, 1536), (513, 2048), (5, 448), (77, 200)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (
        torch.randn(n, k, generator=g, device="cuda")
        * torch.logspace(-2, 0, n, device="cuda")[:, None]
    )
    wq, ws = fp8_ref.quantize_weight(w)
    return x, wq, ws


@pytest.mark.skipif(not fp8_gemm.is_available("cuda"), reason="needs triton on SM90+")
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a8_linear_matches_reference(backend, m, n, k):
    x, wq, ws = operands(m, n, k, m + n + k)
    bias = torch.randn(n, device="cuda").bfloat16()
    out = BACKENDS[backend](x, wq, ws, bias)
    ref = fp8_ref.linear(x.float(), wq, ws, bias.float())
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < TOL


@pytest.mark.skipif(not fp8_gemm.is_available("cuda"), reason="needs triton on SM90+")
@pytest.mark.parametrize("limit", [None, 0.05], ids=["plain", "swiglu-limit"])
@pytest.mark.parametrize("t", [5, 300], ids=["fused-swiglu", "unfused-swiglu"])
def test_fp8_experts_match_reference(limit, t):
    """limit: DeepSeek-V4's swiglu clamp, small enough here to clamp most gate and up values;
    t: tokens either side of triton_moe_fp8.UNFUSED_SWIGLU_FROM."""
    assert 5 < triton_moe_fp8.UNFUSED_SWIGLU_FROM <= 300
    g = torch.Generator(device="cuda").manual_seed(5)
    e, h, inter, k = 8, 1024, 512, 3
    gate_up, gu_s = fp8_ref.quantize_weight(
        torch.randn(e, 2 * inter, h, generator=g, device="cuda") / 30
    )
    down, d_s = fp8_ref.quantize_weight(torch.randn(e, h, inter, generator=g, device="cuda") / 20)
    x = torch.randn(t, h, generator=g, device="cuda").bfloat16()
    ids = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices
    weights = torch.rand(t, k, generator=g, device="cuda")
    args = (gate_up, gu_s, down, d_s, ids, weights)
    ref = fp8_ref.moe_experts(x.float(), *args, limit=limit)
    if limit is not None:  # the clamp matters at these values
        assert rel_err(fp8_ref.moe_experts(x.float(), *args), ref) > 0.1
    # the gate/up product is requantized from bf16 first: 2.1 % off at 5 tokens on an H100
    errors = {"looped": rel_err(fp8_ref.moe_experts(x, *args, fp8_gemm.linear, limit=limit), ref)}
    for grouped in (triton_moe_fp8.moe_experts, triton_moe_fp8.moe_experts_sm1):
        errors[grouped.__name__] = rel_err(grouped(x, *args, limit=limit), ref)
    assert max(errors.values()) < 3 * TOL, errors


@pytest.mark.skipif(not fp8_gemm.is_available("cuda"), reason="needs triton on SM90+")
@pytest.mark.parametrize("limit", [None, 10.0], ids=["plain", "swiglu-limit"])
@pytest.mark.parametrize("tokens", [1, 64, 512, 8192])
def test_fused_gate_up_swiglu_equals_the_unfused_path(tokens, limit):
    """triton_moe_fp8.gate_up_swiglu (the SwiGLU and the down GEMM's quantizer in the gate/up
    GEMM's epilogue) at V4-Flash's widths and at the decode and prefill tiles: the same e4m3
    bytes and scales as the grouped GEMM's bf16 result through swiglu_quantize_act, on every
    real row of the layout."""
    from stages.kernels.moe_routing import route_and_gather_scaled

    g = torch.Generator(device="cuda").manual_seed(tokens)
    e, h, inter, k = 32, 4096, 2048, 6
    gate_up, gu_s = fp8_ref.quantize_weight(
        torch.randn(e, 2 * inter, h, generator=g, device="cuda") / 15
    )
    x = torch.randn(tokens, h, generator=g, device="cuda").bfloat16()
    ids = torch.rand(tokens, e, generator=g, device="cuda").topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=g, device="cuda")
    block_m, warps, stages = triton_moe_fp8.tiles_for(tokens * k, e)
    xq, xs = triton_fp8_act.quantize_act(x)
    r, a, a_s = route_and_gather_scaled(xq.view(torch.uint8), xs, ids, weights, e, block_m)
    a = a.view(fp8_ref.FP8)
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = dict(num_warps=warps, num_stages=stages)
    hb = triton_moe_fp8.grouped_gemm(a, a_s, gate_up, gu_s, r, grid, torch.bfloat16, **cfg)
    want_q, want_s = triton_fp8_act.swiglu_quantize_act(hb, limit)
    # at its own launch (SWIGLU_LAUNCH), on the decode or the prefill tiles' layout
    hq, hs = triton_moe_fp8.gate_up_swiglu(a, a_s, gate_up, gu_s, r, grid, torch.bfloat16, limit)
    real = r.pair_of_row >= 0
    assert int(real.sum()) == tokens * k
    if limit is not None:  # the clamp is reached
        assert bool((hb[real].float().abs() > limit).any())
    assert torch.equal(hs[real], want_s[real]), (hs[real] - want_s[real]).abs().max().item()
    assert torch.equal(hq[real].view(torch.uint8), want_q[real].view(torch.uint8))


@pytest.mark.skipif(not fp8_gemm.is_available("cuda"), reason="needs triton on SM90+")
@pytest.mark.parametrize("scatter", [False, True], ids=["gate_up", "down"])
@pytest.mark.parametrize("tokens", [3, 512, 8192])
def test_grouped_gemm_through_tma_equals_the_pointer_loads(tokens, scatter):
    """triton_moe_fp8.grouped_gemm with tma=True (the prefill tiles' default, PREFILL_TMA)
    against its pointer loads on the same layout, V4-Flash's widths at the decode and prefill
    tiles: the same products, scales and fp32 order, so the same bits."""
    from stages.kernels.moe_routing import route_and_gather_scaled

    g = torch.Generator(device="cuda").manual_seed(tokens + scatter)
    e, h, inter, k = 32, 4096, 2048, 6
    n, kdim = (h, inter) if scatter else (2 * inter, h)
    w, w_s = fp8_ref.quantize_weight(torch.randn(e, n, kdim, generator=g, device="cuda") / 15)
    x = torch.randn(tokens, kdim, generator=g, device="cuda").bfloat16()
    ids = torch.rand(tokens, e, generator=g, device="cuda").topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=g, device="cuda")
    block_m, warps, stages = triton_moe_fp8.tiles_for(tokens * k, e)
    xq, xs = triton_fp8_act.quantize_act(x)
    r, a, a_s = route_and_gather_scaled(xq.view(torch.uint8), xs, ids, weights, e, block_m)
    a = a.view(fp8_ref.FP8)
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    pairs = tokens * k if scatter else None
    cfg = dict(pairs=pairs, num_warps=warps, num_stages=stages)
    want = triton_moe_fp8.grouped_gemm(a, a_s, w, w_s, r, grid, torch.bfloat16, **cfg)
    got = triton_moe_fp8.grouped_gemm(a, a_s, w, w_s, r, grid, torch.bfloat16, tma=True, **cfg)
    rows = slice(None) if scatter else r.pair_of_row >= 0
    diff = (got[rows].float() - want[rows].float()).abs().max().item()
    assert torch.equal(got[rows], want[rows]), diff


@pytest.mark.skipif(triton_fp8_act.triton is None, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,k", QUANT_SHAPES)
def test_fused_activation_quantizer_matches_reference(m, k, dtype):
    """The same e4m3 bytes and float32 scales as fp8_ref.quantize_act on CUDA (rows of very
    different magnitudes, an all-zero row, a ragged last group where K is off the 128 grid),
    row-major and padded + group-major (scaled_mm's layout: padding rows zero, scale 1)."""
    g = torch.Generator(device="cuda").manual_seed(m * k)
    magnitudes = torch.logspace(-4, 3, m, device="cuda")[:, None]
    x = torch.randn(m, k, generator=g, device="cuda") * magnitudes
    x[m // 2] = 0
    x = x.to(dtype)
    want_q, want_s = fp8_ref.quantize_act(x)
    q, s = triton_fp8_act.quantize_act(x)
    assert q.shape == (m, k) and s.shape == want_s.shape and s.is_contiguous()
    assert torch.equal(s, want_s), (s - want_s).abs().max().item()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    rows = m + (-m % 16)
    q, s = triton_fp8_act.quantize_act(x, rows_multiple=16, group_major=True)
    assert q.shape == (rows, k) and s.shape == (rows, want_s.shape[1]) and s.stride(0) == 1
    assert torch.equal(s[:m], want_s) and bool((s[m:] == 1).all())
    assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8))
    assert not q[m:].view(torch.uint8).any()


@pytest.mark.skipif(triton_fp8_act.triton is None, reason="needs triton")
@pytest.mark.parametrize("limit", [None, 10.0])
@pytest.mark.parametrize("m,inter", [(1, 2048), (300, 2048), (77, 200)])
def test_fused_swiglu_quantizer_matches_the_unfused_path(m, inter, limit):
    """silu(gate) * up (DeepSeek-V4's clamp at 10) and the 1 x 128 quantizer in one kernel, on
    the bf16 [gate | up] rows the grouped MoE's first GEMM writes: the bits of torch_ref.swiglu
    then fp8_ref.quantize_act (libdevice's expf is torch's), and the MoE's result unchanged."""
    from stages.kernels import torch_ref

    g = torch.Generator(device="cuda").manual_seed(m + inter)
    gate_up = (torch.randn(m, 2 * inter, generator=g, device="cuda") * 6).bfloat16()
    q, s = triton_fp8_act.swiglu_quantize_act(gate_up, limit)
    want_q, want_s = fp8_ref.quantize_act(
        torch_ref.swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)
    )
    assert torch.equal(s, want_s), (s - want_s).abs().max().item()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


SWIGLU_BACKENDS = {
    "decode-scaled-mm": (
        fp8_gemm.swiglu_linear_decode_scaled_mm,
        fp8_gemm.linear_decode_scaled_mm,
    ),
    "scaled-mm": (fp8_gemm.swiglu_linear_scaled_mm, fp8_gemm.linear_scaled_mm),
    "triton-persistent": (fp8_gemm.swiglu_linear, fp8_gemm.linear),
    "triton-persistent-sm1": (fp8_gemm.swiglu_linear_sm1, fp8_gemm.linear_sm1),
}


@pytest.mark.skipif(triton_fp8_act.triton is None, reason="needs triton")
@pytest.mark.parametrize("backend", list(SWIGLU_BACKENDS))
@pytest.mark.parametrize("m", [1, 300, 8192])
def test_swiglu_down_projection_equals_the_unfused_one(backend, m):
    """fp8_swiglu_linear (a SwiGLU's W8A8 down projection fed its gate | up, the swiglu folded
    into the quantizer) against fp8_linear of torch_ref.swiglu's output, at V4-Flash's shared
    expert (2048 -> 4096, clamp 10): the same bits."""
    from stages.kernels import torch_ref

    fused, unfused = SWIGLU_BACKENDS[backend]
    g = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * 2048, generator=g, device="cuda") * 6).bfloat16()
    weight = (torch.randn(4096, 2048, generator=g, device="cuda") * 0.05).to(fp8_ref.FP8)
    scale_inv = torch.rand(32, 16, generator=g, device="cuda") + 0.5
    want = unfused(torch_ref.swiglu(gate_up[:, :2048], gate_up[:, 2048:], 10.0), weight, scale_inv)
    assert torch.equal(fused(gate_up, 10.0, weight, scale_inv), want)


@pytest.mark.skipif(triton_fp8_latent.triton is None, reason="needs triton")
def test_fused_quantize_on_write_matches_reference():
    """The fused kernel writes the same bytes at the same slots as quantize + index_copy_, and
    leaves every other slot alone."""
    g = torch.Generator(device="cuda").manual_seed(9)
    values = (
        torch.randn(300, 576, generator=g, device="cuda")
        * torch.logspace(-3, 2, 300, device="cuda")[:, None]
    )
    values = values.bfloat16()
    slots = torch.randperm(1024, generator=g, device="cuda")[:300]
    fused = torch.randint(0, 255, (1024, 656), generator=g, device="cuda", dtype=torch.uint8)
    ref = fused.clone()
    triton_fp8_latent.write(fused, values, slots)
    ref.index_copy_(0, slots, fp8_latent.quantize(values))
    assert torch.equal(fused, ref)


@pytest.mark.skipif(not flash_mla.is_available("cuda"), reason="needs sgl-flash-mla on SM90")
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_sparse_fp8_kernel_on_prefill_rows(heads):
    """A 1K-token chunk's queries over a 6K prefix, each its own row of the decode kernel (the
    FP8 cache's prefill path), and a state shared by two calls (two layers)."""
    g = torch.Generator(device="cuda").manual_seed(heads)
    blocks, t, topk = 100, 1024, 2048
    latent = (torch.randn(blocks * 64, 576, generator=g, device="cuda") / 4).bfloat16()
    pages = fp8_latent.quantize(latent).view(blocks, 64, 1, fp8_latent.BYTES)
    positions = torch.arange(5000, 5000 + t, device="cuda")
    scores = torch.rand(t, 6024, generator=g, device="cuda")
    scores = scores.masked_fill(torch.arange(6024, device="cuda")[None] > positions[:, None], -1)
    val, idx = scores.topk(topk, dim=-1)
    indices = idx.int().masked_fill(val < 0, -1)
    q = torch.randn(t, heads, 576, generator=g, device="cuda").bfloat16()
    state: dict = {}
    out = flash_mla.mla_sparse_fp8(q, pages, indices, 512, 192**-0.5, state)
    ref = fp8_latent.mla_sparse(q.float(), pages, indices, 512, 192**-0.5, {})
    assert out.shape == (t, heads, 512)
    assert rel_err(out, ref) < TOL
    assert torch.equal(flash_mla.mla_sparse_fp8(q, pages, indices, 512, 192**-0.5, state), out)
    # the dequantizing prefill backend: the prefix's keys (slots 0..6023, here in a shuffled
    # order) dequantized, FlashMLA's bf16 sparse prefill kernel over them
    slots = torch.randperm(6024, generator=g, device="cuda")
    position = torch.full((blocks * 64,), -1, dtype=torch.int32, device="cuda")
    position[slots] = torch.arange(6024, dtype=torch.int32, device="cuda")
    plan = {flash_mla.PREFIX_KEYS: (slots, position)}
    via_bf16 = flash_mla.mla_sparse_fp8_via_bf16(q, pages, indices, 512, 192**-0.5, plan)
    assert via_bf16.shape == (t, heads, 512) and rel_err(via_bf16, ref) < TOL


@pytest.mark.skipif(not fp8_gemm.is_available("cuda"), reason="needs triton on SM90+")
def test_v32_stage_fp8_against_bf16():
    """A V3.2-shaped random model (FP8 latent shape, 128-aligned widths) on CUDA: FP8 weights
    (W8A8 on the auto backend) and the FP8 latent cache against bf16: logits close, greedy
    tokens through chunked prefill and decode mostly the same."""
    from app.bench.fp8 import accuracy

    # prompts within index_topk (dense attention); bf16 itself is about 0.07 off fp32 on this
    # random model (app.bench.fp8's yardstick row), FP8 a few times that
    row = accuracy(weights_fp8=True, kv_fp8=True, prompt_len=48, steps=8, prompts=2)
    assert row["logits_rel_err"] < 0.4
    assert row["greedy_agreement"] >= 0.5


@pytest.mark.skipif(not fp8_gemm.is_available("cuda"), reason="needs triton on SM90+")
def test_v4_stage_fp8_against_bf16():
    """A V4-shaped random model (head dim 512, CSA 4 with top-64 past 256 tokens, HCA 128, a
    hash layer) on CUDA: FP8 weights (W8A8 linears and experts, the swiglu clamp) and the
    584-byte FP8 cache on FlashMLA's sparse FP8 kernel against bf16."""
    from app.bench.fp8 import accuracy

    row = accuracy(weights_fp8=True, kv_fp8=True, prompt_len=320, steps=8, prompts=2, model="v4")
    assert row["logits_rel_err"] < 0.4
    assert row["greedy_agreement"] >= 0.5

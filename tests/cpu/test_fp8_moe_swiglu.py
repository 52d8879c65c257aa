"""The FP8 grouped MoE's gate/up GEMM with the SwiGLU and the down GEMM's 1 x 128 quantizer in
its epilogue (triton_moe_fp8.gate_up_swiglu), under Triton's interpreter, against the unfused
path it replaces (the grouped GEMM's result in the activations' dtype, then the fused
swiglu quantizer): the same bytes and scales on every real row of the layout, the expert
padding left unwritten. tests/gpu/test_fp8_kernels.py takes the whole MoE against fp8_ref on
CUDA; tests/cpu/test_triton_compile_sm90.py compiles the kernel for sm_90."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_ref, moe_routing, triton_fp8_act

pytestmark = [
    pytest.mark.interpreter,
    # the unfused reference quantizes every row of its buffer, the unwritten ones past the
    # layout's tiles too (garbage, never compared): numpy warns of their overflows
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

SENTINEL = 0x55  # a byte no row of the layout starts with: padding rows must keep it


def _layout(t: int, k: int, experts: int, block_m: int, hidden: int, g: torch.Generator):
    """A batch's routing with torch ops (moe_routing.route) and its FP8 rows placed in it."""
    x = torch.randn(t, hidden, generator=g)
    x[1 % t] *= 6  # rows of different magnitudes get different scales
    xq, xs = fp8_ref.quantize_act(x)
    ids = torch.rand(t, experts, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(t, k, generator=g)
    r = moe_routing.route(ids, weights, experts, block_m)
    rows = r.pair_of_row.numel()
    token = (r.pair_of_row.long().clamp(min=0) // k)[:rows]
    a = xq.view(torch.uint8)[token].view(fp8_ref.FP8)
    return r, a, xs[token].contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize(
    "t,k,experts,inter,hidden",
    [(1, 2, 4, 128, 256), (5, 3, 4, 256, 384), (37, 2, 8, 256, 200)],
    ids=["one-token", "few", "ragged-k"],
)
def test_fused_gate_up_equals_the_gemm_then_the_quantizer(
    triton_interpreter, t, k, experts, inter, hidden, limit, dtype
):
    from stages.kernels import triton_moe_fp8 as moe

    g = torch.Generator().manual_seed(t * 31 + inter + hidden)
    block_m = 16
    r, a, a_scale = _layout(t, k, experts, block_m, hidden, g)
    w = torch.randn(experts, 2 * inter, hidden, generator=g) / 64
    w[:, :inter] *= 3  # gate and up of different scales: a swap of the halves shows
    gate_up, gu_scale = fp8_ref.quantize_weight(w)
    cfg = dict(num_warps=4, num_stages=1)
    h = moe.grouped_gemm(a, a_scale, gate_up, gu_scale, r, 3, dtype, **cfg)
    want_q, want_s = triton_fp8_act._swiglu_quantize(h, limit)
    hq, hs = moe.gate_up_swiglu(a, a_scale, gate_up, gu_scale, r, 3, dtype, limit, **cfg)
    real = r.pair_of_row >= 0
    assert hq.shape == (a.shape[0], inter) and hs.shape == (a.shape[0], inter // 128)
    assert int(real.sum()) == t * k
    assert torch.equal(hq[real].view(torch.uint8), want_q[real].view(torch.uint8))
    assert torch.equal(hs[real], want_s[real])
    if limit is not None:  # the clamp is reached at these values, so it is tested
        assert bool((h[real][:, :inter].float() > limit).any())


@pytest.mark.parametrize("scatter", [False, True], ids=["gate-up", "down"])
@pytest.mark.parametrize(
    "t,k,experts,n,hidden", [(1, 2, 4, 256, 128), (1, 2, 4, 256, 256), (37, 2, 8, 384, 384)]
)
def test_grouped_gemm_through_tma_equals_pointer_loads(
    triton_interpreter, monkeypatch, t, k, experts, n, hidden, scatter
):
    """grouped_gemm's TMA descriptors (tma=True) read the tiles its pointer loads read: the same
    results on every row it stores (the layout's rows, or each pair's slot)."""
    from triton.tools import tensor_descriptor

    from stages.kernels import triton_moe_fp8 as moe

    made: list[tuple[int, ...]] = []
    descriptor = tensor_descriptor.TensorDescriptor

    def counted(base, shape, strides, block_shape):
        made.append(tuple(block_shape))
        return descriptor(base, shape, strides, block_shape)

    monkeypatch.setattr(tensor_descriptor, "TensorDescriptor", counted)

    g = torch.Generator().manual_seed(t + n)
    r, a, a_scale = _layout(t, k, experts, 16, hidden, g)
    w, w_scale = fp8_ref.quantize_weight(torch.randn(experts, n, hidden, generator=g) / 32)
    cfg = dict(num_warps=4, num_stages=1, pairs=t * k if scatter else None)
    want = moe.grouped_gemm(a, a_scale, w, w_scale, r, 3, torch.bfloat16, **cfg)
    assert not made
    got = moe.grouped_gemm(a, a_scale, w, w_scale, r, 3, torch.bfloat16, tma=True, **cfg)
    assert made == [(16, 128), (1, 128, 128)]  # the tiles went through the descriptors
    rows = slice(None) if scatter else r.pair_of_row >= 0
    assert torch.equal(got[rows], want[rows])


def test_grouped_gemm_through_tma_refuses_unaligned_rows(triton_interpreter):
    """TMA needs 16-byte rows: K = 136 is asked for plainly, not served by pointer loads."""
    from stages.kernels import triton_moe_fp8 as moe

    g = torch.Generator().manual_seed(3)
    r, a, a_scale = _layout(2, 2, 4, 16, 256, g)
    a = a[:, :136].contiguous()
    w, w_scale = fp8_ref.quantize_weight(torch.randn(4, 128, 256, generator=g) / 32)
    w = w[:, :, :136].contiguous()
    with pytest.raises(ValueError, match="K % 16 == 0, got K=136"):
        moe.grouped_gemm(a, a_scale, w, w_scale, r, 2, torch.bfloat16, tma=True)


def test_padding_rows_of_the_layout_are_left_unwritten(triton_interpreter):
    """A decode batch's layout is mostly padding (each expert's rows rounded up to the tile):
    the kernel stores only the real rows."""
    from stages.kernels import triton_moe_fp8 as moe

    g = torch.Generator().manual_seed(7)
    r, a, a_scale = _layout(3, 2, 4, 16, 128, g)
    gate_up, gu_scale = fp8_ref.quantize_weight(torch.randn(4, 256, 128, generator=g))
    real = r.pair_of_row >= 0
    assert int((~real).sum()) > 0
    out_q = torch.full((a.shape[0], 128), SENTINEL, dtype=torch.uint8)
    out_s = torch.full((a.shape[0], 1), -1.0)
    hq, hs = moe.gate_up_swiglu(
        a, a_scale, gate_up, gu_scale, r, 2, torch.float16, out=(out_q.view(fp8_ref.FP8), out_s)
    )
    assert hq.data_ptr() == out_q.data_ptr()
    assert bool((out_q[~real] == SENTINEL).all()) and bool((out_s[~real] == -1).all())
    assert not bool((out_q[real] == SENTINEL).all(dim=1).any())
    assert bool((out_s[real] > 0).all())


def test_an_intermediate_width_off_the_grid_is_refused():
    from stages.kernels import triton_moe_fp8 as moe

    if moe.triton is None:
        pytest.skip("needs triton")
    r = moe_routing.route(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), 2, 16)
    q = torch.zeros(16, 128, dtype=fp8_ref.FP8)
    with pytest.raises(ValueError, match="128 grid"):
        moe.gate_up_swiglu(q, torch.ones(16, 1), q.new_zeros(2, 400, 128), torch.ones(2, 4, 1),
                           r, 1, torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize("scatter", [False, True], ids=["gate_up", "down"])
def test_prefill_tiles_go_through_tma_descriptors_with_the_same_bits(
    triton_interpreter, monkeypatch, scatter
):
    """At the prefill tiles _grouped loads through TMA descriptors (PREFILL_TMA, the default)
    with PREFILL_PROGRAMS_PER_SM programs an SM (three here, as the bench's sweep launches
    them): the same products, scales and sums as the pointer loads on one program an SM; a tile
    past N reads zeros, not the next expert's rows (N = 192 on the 128 grid)."""
    from stages.kernels import triton_moe_fp8 as moe

    assert moe.PREFILL_TMA
    monkeypatch.setattr(moe, "PREFILL_PROGRAMS_PER_SM", 3)
    calls: list[tuple[int, bool]] = []
    grouped_gemm = moe.grouped_gemm
    monkeypatch.setattr(
        moe, "grouped_gemm", lambda *a: calls.append((a[5], a[-1])) or grouped_gemm(*a)
    )

    g = torch.Generator().manual_seed(11)
    r, a, a_scale = _layout(5, 2, 4, moe.PREFILL_TILES[0], 256, g)
    w, w_scale = fp8_ref.quantize_weight(torch.randn(4, 192, 256, generator=g) / 32)
    pairs = 10 if scatter else None
    want = grouped_gemm(a, a_scale, w, w_scale, r, 2, torch.bfloat16, pairs=pairs)
    got = moe._grouped(a, a_scale, w, w_scale, r, 2, torch.bfloat16, pairs, moe.PREFILL_TILES)
    assert calls == [(2 * 3, True)]  # programs, tma
    rows = slice(None) if scatter else r.pair_of_row >= 0
    assert torch.equal(got[rows], want[rows])
    with pytest.raises(ValueError, match="K % 16"):
        grouped_gemm(a[:, :200], a_scale, w[..., :200], w_scale, r, 2, torch.bfloat16, tma=True)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_block_scaled_k_loops_against_fp8_ref(triton_interpreter, tma):
    """The grouped GEMM's block-scaled K loops (pointer loads or TMA, each K tile's scales
    loaded a step ahead), stored by row and at each pair's slot, against the dequantized
    product (fp8_ref) with every row's tile's expert: three K tiles whose activation and weight
    scales differ eightfold, so a scale taken from the wrong step shows."""
    from stages.kernels import triton_moe_fp8 as moe

    g = torch.Generator().manual_seed(5)
    r, a, a_scale = _layout(6, 2, 4, 16, 384, g)
    a_scale[:, 1] *= 8
    w = torch.randn(4, 256, 384, generator=g) / 32
    w[..., 256:] *= 8
    w, w_scale = fp8_ref.quantize_weight(w)
    cfg = dict(num_warps=4, num_stages=1, tma=tma)
    rows = moe.grouped_gemm(a, a_scale, w, w_scale, r, 3, torch.float32, **cfg)
    slots = moe.grouped_gemm(a, a_scale, w, w_scale, r, 3, torch.float32, pairs=12, **cfg)
    real = (r.pair_of_row >= 0).nonzero().flatten()
    experts = r.tile_expert.long()[real // r.block_m]
    x = fp8_ref.dequantize_act(a[real], a_scale[real])
    want = torch.einsum("rk,rnk->rn", x, fp8_ref.dequantize_weight(w, w_scale)[experts])
    torch.testing.assert_close(rows[real], want, rtol=1e-5, atol=1e-5)
    pair = r.pair_of_row.long()[real]  # at the pair's slot unweighted: the combine weighs it
    torch.testing.assert_close(slots[pair], want, rtol=1e-5, atol=1e-5)


def test_a_tokens_rows_keep_their_bits_alone_and_batched(triton_interpreter):
    """The FP8 MoE's decode path at the kernels (the fused gate/up, then the down GEMM stored at
    each pair's slot): a token's slots are the same bytes alone and third of six tokens, its
    rows then at other places in tiles its experts share with other tokens' rows (the engine's
    batched-vs-alone property)."""
    from stages.kernels import moe_routing
    from stages.kernels import triton_moe_fp8 as moe

    g = torch.Generator().manual_seed(23)
    experts, k, hidden, inter, block_m = 4, 2, 256, 256, 16
    x = torch.randn(6, hidden, generator=g)
    x[1] *= 6
    ids = torch.rand(6, experts, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(6, k, generator=g)
    gate_up, gu_scale = fp8_ref.quantize_weight(
        torch.randn(experts, 2 * inter, hidden, generator=g) / 64
    )
    down, d_scale = fp8_ref.quantize_weight(torch.randn(experts, hidden, inter, generator=g) / 32)
    cfg = dict(num_warps=4, num_stages=1)

    def slots(tokens: list[int]) -> torch.Tensor:
        xq, xs = fp8_ref.quantize_act(x[tokens])
        r = moe_routing.route(ids[tokens], weights[tokens], experts, block_m)
        token = r.pair_of_row.long().clamp(min=0) // k
        a = xq.view(torch.uint8)[token].view(fp8_ref.FP8)
        hq, hs = moe.gate_up_swiglu(
            a, xs[token].contiguous(), gate_up, gu_scale, r, 3, torch.bfloat16, **cfg
        )
        y = moe.grouped_gemm(hq, hs, down, d_scale, r, 3, torch.bfloat16, len(tokens) * k, **cfg)
        return y.view(len(tokens), k, hidden)

    alone, batched = slots([2]), slots([0, 1, 2, 3, 4, 5])
    assert torch.equal(batched[2].view(torch.int16), alone[0].view(torch.int16))
    assert bool((alone.float().abs() > 0).any())

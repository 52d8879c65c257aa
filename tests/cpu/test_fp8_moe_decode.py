"""The decode step's FP8 experts with the weight rows as the MMA's wide side (stages/kernels/
triton_moe_fp8_decode.py) under Triton's interpreter, against triton_moe_fp8's kernels on the
same 16-row layout: the gate/up SwiGLU epilogue's bytes and scales on every real row, and the
down GEMM's rows at their pairs' slots. The operands are small integers in e4m3 with power-of-two
scales, so every sum is exact in any order and the comparison is of what each kernel reads and
where it writes (tests/gpu/test_fp8_moe_decode_cuda.py compares bits on the device)."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_ref, moe_routing

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


def _ints(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-8, 9, shape, generator=g).float().to(fp8_ref.FP8)


def _pow2(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.exp2(torch.randint(-9, -4, shape, generator=g).float())


def _layout(t: int, k: int, experts: int, hidden: int, g: torch.Generator):
    """A batch's routing (moe_routing.route, 16-row tiles) and its FP8 rows placed in it."""
    xq, xs = _ints(g, t, hidden), _pow2(g, t, hidden // 128)
    ids = torch.rand(t, experts, generator=g).topk(k, dim=-1).indices
    r = moe_routing.route(ids, torch.rand(t, k, generator=g), experts, 16)
    token = r.pair_of_row.long().clamp(min=0) // k
    return r, xq[token], xs[token].contiguous()


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("t,k,experts,inter,hidden", [(1, 3, 4, 128, 256), (19, 2, 4, 256, 384)])
def test_swapped_gate_up_equals_the_grouped_kernel(triton_interpreter, t, k, experts, inter,
                                                   hidden, limit):  # fmt: skip
    from stages.kernels import triton_moe_fp8 as moe
    from stages.kernels import triton_moe_fp8_decode as swapped

    g = torch.Generator().manual_seed(t + inter)
    r, a, a_scale = _layout(t, k, experts, hidden, g)
    gate_up = _ints(g, experts, 2 * inter, hidden)
    gu_scale = _pow2(g, experts, 2 * inter // 128, hidden // 128)
    gu_scale[:, : inter // 128] *= 4  # gate and up scaled apart: a swap of the halves shows
    want_q, want_s = moe.gate_up_swiglu(a, a_scale, gate_up, gu_scale, r, 3, torch.bfloat16,
                                        limit, num_warps=4, num_stages=1)  # fmt: skip
    hq, hs = swapped.gate_up_swiglu(a, a_scale, gate_up, gu_scale, r, torch.bfloat16, limit)
    real = r.pair_of_row >= 0
    assert int(real.sum()) == t * k
    assert torch.equal(hq[real].view(torch.uint8), want_q[real].view(torch.uint8))
    assert torch.equal(hs[real], want_s[real])
    assert bool((hs[real] > fp8_ref.MIN_SCALE / fp8_ref.FP8_MAX).any())  # not all zeros


@pytest.mark.parametrize("t,k,experts,n,inter", [(1, 3, 4, 256, 128), (19, 2, 4, 192, 256)])
def test_swapped_down_equals_the_grouped_kernel_at_each_pair(triton_interpreter, t, k, experts,
                                                             n, inter):  # fmt: skip
    from stages.kernels import triton_moe_fp8 as moe
    from stages.kernels import triton_moe_fp8_decode as swapped

    g = torch.Generator().manual_seed(t + n)
    r, a, a_scale = _layout(t, k, experts, inter, g)
    w, w_scale = _ints(g, experts, n, inter), _pow2(g, experts, -(-n // 128), inter // 128)
    want = moe.grouped_gemm(a, a_scale, w, w_scale, r, 3, torch.bfloat16, pairs=t * k,
                            num_warps=4, num_stages=1)  # fmt: skip
    got = swapped.down(a, a_scale, w, w_scale, r, torch.bfloat16, t * k)
    assert got.shape == (t * k, n)
    assert torch.equal(got, want) and bool(got.abs().sum() > 0)


def test_layouts_of_other_tiles_are_refused():
    from stages.kernels import triton_moe_fp8_decode as swapped

    if swapped.triton is None:
        pytest.skip("needs triton")
    r = moe_routing.route(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), 2, 64)
    q = torch.zeros(64, 128, dtype=fp8_ref.FP8)
    with pytest.raises(ValueError, match="16-row tiles"):
        swapped.down(q, torch.ones(64, 1), q.new_zeros(2, 128, 128), torch.ones(2, 1, 1), r,
                     torch.bfloat16, 1)  # fmt: skip


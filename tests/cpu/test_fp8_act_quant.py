"""The 1 x 128 activation quantizer: fp8_ref's scale rule written out (the group's largest
magnitude times float32 1/448, so CPU and CUDA compute the same bits), and the fused quantizer's
padded, group-major outputs on its torch path (tests/gpu/test_fp8_kernels.py checks the Triton
kernel against fp8_ref on CUDA; tests/cpu/test_triton_compile_sm90.py compiles it for sm_90)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.kernels import fp8_ref, triton_fp8_act


def test_scale_is_the_group_max_times_the_float32_reciprocal_of_448():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    x[5] = 0  # an all-zero row keeps the floor
    q, s = fp8_ref.quantize_act(x)
    padded = torch.nn.functional.pad(x, (0, 84)).view(37, 3, 128).numpy()
    amax = np.maximum(np.abs(padded).max(axis=-1), np.float32(fp8_ref.MIN_SCALE))
    want = amax * np.float32(1 / 448)  # float32 by float32, IEEE-rounded
    assert np.array_equal(s.numpy(), want)
    ratio = (padded / want[..., None]).reshape(37, 384)[:, :300]
    expect = torch.from_numpy(np.ascontiguousarray(ratio)).to(fp8_ref.FP8)
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("m,k", [(1, 128), (37, 448), (16, 256), (33, 640)])
@pytest.mark.parametrize("group_major", [False, True])
def test_padded_group_major_outputs_match_the_reference(m, k, group_major):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).bfloat16()
    q, s = triton_fp8_act.quantize_act(x, rows_multiple=16, group_major=group_major)
    rows = -(-m // 16) * 16
    assert q.shape == (rows, k) and s.shape == (rows, -(-k // 128))
    if group_major:  # a [rows, groups] view of a [groups, rows] tensor
        assert s.stride() == (1, rows) and s.T.is_contiguous()
    want_q, want_s = fp8_ref.quantize_act(x)
    assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s[:m], want_s)
    assert not q[m:].view(torch.uint8).any() and bool((s[m:] == 1).all())


def _interpreted_quantizer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize_1x128 launched on the interpreter (whose e4m3 rounding is not CUDA's)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=fp8_ref.FP8)
    s = torch.empty(m, -(-k // 128))
    triton_fp8_act._quantize_1x128[(-(-m // triton_fp8_act.LAUNCH[0]), s.shape[1])](
        x, q, s, m, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        INV_FP8_MAX=1 / fp8_ref.FP8_MAX, MIN_SCALE=fp8_ref.MIN_SCALE,
        BLOCK_M=triton_fp8_act.LAUNCH[0], GROUP=fp8_ref.BLOCK,
    )  # fmt: skip
    return q, s


@pytest.mark.parametrize("limit", [None, 1.5])
@pytest.mark.parametrize("m,inter", [(5, 128), (37, 384), (16, 200)])
def test_interpreted_swiglu_quantizer_matches_the_unfused_path(triton_interpreter, m, inter, limit):
    """The fused silu(gate) * up (clamped at a limit) and 1 x 128 quantizer against torch_ref's
    swiglu then the plain quantizer kernel, both interpreted, on fp16 gate/up halves (the
    interpreter's bf16 and e4m3 roundings are not CUDA's; tests/gpu/test_fp8_kernels.py takes
    bf16 against fp8_ref on CUDA): the same bits."""
    from stages.kernels import torch_ref

    g = torch.Generator().manual_seed(m + inter)
    gate_up = (torch.randn(m, 2 * inter, generator=g) * 2).half()
    q, s = triton_fp8_act._swiglu_quantize(gate_up, limit)
    h = torch_ref.swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)
    want_q, want_s = _interpreted_quantizer(h)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


@pytest.mark.parametrize("group_major", [False, True])
def test_interpreted_swiglu_quantizer_in_the_scaled_mm_layout(triton_interpreter, group_major):
    """The padded, group-major outputs cuBLASLt's GEMM reads (fp8_gemm.swiglu_linear_scaled_mm):
    the rows the unpadded call writes, zeros with scale 1 after them."""
    g = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(21, 512, generator=g) * 2).half()
    want_q, want_s = triton_fp8_act._swiglu_quantize(gate_up, 2.0)
    q, s = triton_fp8_act._swiglu_quantize(gate_up, 2.0, rows_multiple=16, group_major=group_major)
    assert q.shape == (32, 256) and s.shape == (32, 2)
    if group_major:
        assert s.stride() == (1, 32)
    assert torch.equal(q[:21].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s[:21], want_s)
    assert not q[21:].view(torch.uint8).any() and bool((s[21:] == 1).all())


def test_interpreted_swiglu_quantizer_skips_rows_that_are_not_live(triton_interpreter, monkeypatch):
    """live (the grouped MoE's pair_of_row, -1 on the layout's expert padding): the live rows'
    bits are the whole call's, the others are neither read nor written (their buffers keep what
    they held, as the fused gate/up epilogue leaves them)."""
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(40, 512, generator=g) * 2).half()
    live = torch.full((40,), -1, dtype=torch.int32)
    live[[0, 3, 4, 17, 31, 39]] = torch.arange(6, dtype=torch.int32)
    want_q, want_s = triton_fp8_act._swiglu_quantize(gate_up, 2.0)
    buffers = triton_fp8_act._buffers

    def marked(*args):
        q, s = buffers(*args)
        return q.fill_(7.0), s.fill_(-3.0)

    monkeypatch.setattr(triton_fp8_act, "_buffers", marked)
    q, s = triton_fp8_act._swiglu_quantize(gate_up, 2.0, live=live)
    on = live >= 0
    assert torch.equal(q[on].view(torch.uint8), want_q[on].view(torch.uint8))
    assert torch.equal(s[on], want_s[on])
    assert bool((q[~on].float() == 7.0).all()) and bool((s[~on] == -3.0).all())


@pytest.mark.parametrize("limit", [None, 3.0])
def test_swiglu_down_projection_is_the_down_projection_of_the_swiglu(limit):
    """Linear.forward_swiglu (a SwiGLU's down projection fed gate | up) on FP8 weights with the
    torch kernels (fp8_swiglu_linear's reference) and on bf16 weights: forward(swiglu(...))."""
    from stages.kernels import torch_ref
    from stages.kernels.registry import select_kernels
    from stages.models.layers import Linear

    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(7, 512, generator=g) * 2).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    for fp8 in ("torch", None):
        kernels = select_kernels("cpu", fp8_linear=fp8)
        down = Linear(256, 128, False, kernels, torch.bfloat16, "cpu")
        with torch.no_grad():
            if down.weight_scale_inv is not None:
                w = torch.randn(128, 256, generator=g)
                down.weight.copy_(w.to(fp8_ref.FP8))
                down.weight_scale_inv.copy_(torch.rand(1, 2, generator=g) + 0.5)
            else:
                down.weight.copy_(torch.randn(128, 256, generator=g).bfloat16())
        assert (down.weight_scale_inv is not None) == (fp8 is not None)
        want = down(torch_ref.swiglu(gate, up, limit))
        assert torch.equal(down.forward_swiglu(gate_up, limit), want)

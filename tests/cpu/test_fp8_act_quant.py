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
    triton_fp8_act._quantize_1x128[(-(-m // triton_fp8_act.BLOCK_M), s.shape[1])](
        x, q, s, m, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        INV_FP8_MAX=1 / fp8_ref.FP8_MAX, MIN_SCALE=fp8_ref.MIN_SCALE,
        BLOCK_M=triton_fp8_act.BLOCK_M, GROUP=fp8_ref.BLOCK,
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

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

"""The grouped MoE kernels' combine (stages/kernels/triton_moe_combine.py) on CUDA at
DeepSeek-V4-Flash's shapes (top-6 over a 4096-wide hidden, an 8K chunk and decode rows), picks
of another rank's experts (-1) skipped, against torch's fp32 sum over zeros in their slots."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import triton_moe_combine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("t", [8192, 512, 1])
@pytest.mark.parametrize("skipped", [0.0, 0.5])
def test_combine_matches_torchs_sum(t, skipped):
    k, hidden = 6, 4096
    g = torch.Generator(device="cuda").manual_seed(t)
    y = torch.randn(t * k, hidden, generator=g, device="cuda").bfloat16()
    ids = torch.randint(0, 256, (t, k), generator=g, device="cuda")
    ids[torch.rand(t, k, generator=g, device="cuda") < skipped] = -1
    y.view(t, k, hidden)[ids < 0] = float("nan")  # unwritten slots
    zeros = y.view(t, k, hidden).masked_fill((ids < 0)[..., None], 0)
    want = zeros.sum(dim=1, dtype=torch.float32).bfloat16()
    got = triton_moe_combine.combine(y, ids, torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert (got != want).float().mean() < 1e-3

"""The grouped MoE kernels' last step (stages/kernels/triton_moe_combine.py) under Triton's CPU
interpreter: each token's valid picks' rows summed in fp32 and cast, against torch's sum over a
buffer whose unwritten slots are zeros; a pick with id -1 (another rank's expert) is skipped,
whatever its slot holds."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("t,k,hidden", [(5, 6, 64), (1, 6, 1000), (9, 2, 520), (4, 8, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_combine_matches_torchs_sum(triton_interpreter, t, k, hidden, dtype):
    from stages.kernels import triton_moe_combine

    gen = torch.Generator().manual_seed(t * k + hidden)
    y = torch.randn(t * k, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, 16, (t, k), generator=gen)
    ids[torch.rand(t, k, generator=gen) < 0.25] = -1  # picks this rank does not hold
    y.view(t, k, hidden)[ids < 0] = float("nan")  # never written: whatever the buffer held
    zeros = y.view(t, k, hidden).masked_fill((ids < 0)[..., None], 0)
    want = zeros.sum(dim=1, dtype=torch.float32).to(dtype)
    got = triton_moe_combine.combine(y, ids, dtype)
    assert got.shape == (t, hidden) and got.dtype == dtype
    # fp32 sums of k terms in another order: bf16 results the same but for a rare rounding
    torch.testing.assert_close(
        got.float(), want.float(), rtol=2**-7 if dtype != torch.float32 else 1e-6, atol=1e-6
    )
    assert (got != want).float().mean() < 0.01

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


@pytest.mark.parametrize("by_row", [False, True], ids=["at-pairs", "by-row"])
def test_interpreted_combine_weighs_picks_as_the_reference(triton_interpreter, by_row):
    """weights: each pick's row times its routing weight in fp32, as torch_ref.per_expert
    weighs an expert's bf16 output; rows: each pick's row read where the routing layout put it
    (row_of_pair: DeepGEMM's GEMM writes no pair slots), the same bits as read at the pairs."""
    from stages.kernels import triton_moe_combine

    t, k, hidden = 7, 3, 600
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(t * k, hidden, generator=gen).bfloat16()
    ids = torch.randint(0, 8, (t, k), generator=gen)
    ids[2, 1] = -1
    weights = torch.rand(t, k, generator=gen)
    want = (y.view(t, k, hidden).float() * weights[..., None]).masked_fill((ids < 0)[..., None], 0)
    want = want.sum(dim=1).bfloat16()
    at_pairs = triton_moe_combine.combine(y, ids, torch.bfloat16, weights=weights)
    torch.testing.assert_close(at_pairs.float(), want.float(), rtol=2**-7, atol=1e-6)
    if by_row:  # the same rows shuffled into a layout of 40 rows, read back through rows
        perm = torch.randperm(40, generator=gen)[: t * k]
        layout = torch.full((40, hidden), float("nan")).bfloat16()
        layout[perm] = y
        got = triton_moe_combine.combine(
            layout, ids, torch.bfloat16, weights=weights, rows=perm.int()
        )
        assert torch.equal(got.view(torch.int16), at_pairs.view(torch.int16))

"""flash-split on the GPU against the torch reference (fp32 math on the same bf16 inputs).

Tolerance: max abs error 2e-2 on outputs of magnitude ~1 (bf16 output rounding is 8e-3)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("t,length", [(4096, 4096), (4096, 32768), (1, 9000), (100, 1000),
                                      (8192, 131072)])
def test_flash_split_matches_reference(t, length):
    from stages.kernels import flash_split, torch_ref

    g = torch.Generator(device="cuda").manual_seed(t + length)
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(length, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(length, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    got = flash_split.attention(q, k, v, 128 ** -0.5).float()
    rows = slice(0, min(t, 512))  # the fp32 reference on a slice of queries keeps memory small
    qs = q[rows].float()
    want = torch_ref.attention(qs, k.float()[: length - t + qs.shape[0]],
                               v.float()[: length - t + qs.shape[0]], 128 ** -0.5)
    assert (got[rows] - want).abs().max().item() <= 2e-2

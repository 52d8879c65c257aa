"""The split-and-merge of flash_split (prefix without mask + causal diagonal, merged by
log-sum-exp) equals the torch reference's bottom-right causal attention. On CPU the halves run
the math version of the same contract; tests/gpu checks the flash kernels themselves."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import flash_split, torch_ref


@pytest.mark.parametrize("t,length,hq,hkv", [(5, 5, 4, 2), (5, 23, 4, 2), (1, 17, 4, 4),
                                             (16, 64, 6, 1), (7, 8, 2, 2)])
def test_split_merge_matches_reference(t, length, hq, hkv):
    g = torch.Generator().manual_seed(t * 100 + length)
    q = torch.randn(t, hq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(length, hkv, 16, generator=g, dtype=torch.float64)
    v = torch.randn(length, hkv, 16, generator=g, dtype=torch.float64)
    want = torch_ref.attention(q, k, v, 0.25)
    got = flash_split.attention(q, k, v, 0.25)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_not_chosen_on_cpu():
    assert not flash_split.is_available("cpu")

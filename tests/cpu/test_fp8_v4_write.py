"""DeepSeek-V4's FP8 latent write (stages/kernels/triton_fp8_latent.write_v4) with the token's
other rows beside it (a CSA layer's compressor and indexer inputs, copied at the same slots by
the same launch): under Triton's interpreter, the same bytes as the torch path (the latent's
reference write, then one index_copy_ a component), strided sources and unwritten slots
included; and the cache's write_token_rows on CPU against its one-write-each form."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import fp8_v4, triton_fp8_latent


def _case(copies: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pages = fp8_v4.allocate(3, 8, "cpu")
    values = torch.randn(5, 512, generator=g).bfloat16() * 3
    slots = torch.tensor([9, 0, 23, 4, 17])
    # the x_proj output's columns: strided rows, as V4Attention hands them over
    parts = torch.randn(5, 640 + 96, generator=g).bfloat16().split([640, 96], dim=1)
    dsts = [torch.zeros(24, 640, dtype=torch.bfloat16), torch.zeros(24, 96, dtype=torch.bfloat16)]
    rows = tuple(zip(dsts, parts))[:copies]
    return pages, values, slots, rows


@pytest.mark.parametrize("copies", [0, 1, 2])
def test_interpreted_write_with_rows_is_the_torch_path(triton_interpreter, monkeypatch, copies):
    pages, values, slots, rows = _case(copies)
    want_pages = pages.clone()
    want_rows = tuple((d.clone(), s) for d, s in rows)
    triton_fp8_latent.write_v4(want_pages, values, slots, want_rows)  # off CUDA: torch's
    monkeypatch.setattr(triton_fp8_latent, "_torch_path", lambda *args: False)
    triton_fp8_latent.write_v4(pages, values, slots, rows)
    assert torch.equal(pages.view(torch.uint8), want_pages.view(torch.uint8))
    for (got, _), (want, src) in zip(rows, want_rows):
        assert torch.equal(got, want)
        assert torch.equal(got[slots], src) and not got[1].any()  # slot 1: not written


def test_rows_it_does_not_take_are_refused():
    pages, values, slots, rows = _case(2)
    with pytest.raises(ValueError, match="up to 2"):
        triton_fp8_latent.write_v4(pages, values, slots, rows + rows[:1])
    dst, src = rows[0]
    with pytest.raises(ValueError, match="up to 2"):
        triton_fp8_latent.write_v4(pages, values, slots, ((dst.float(), src),))
    with pytest.raises(ValueError, match="up to 2"):  # a source row short: no row per token
        triton_fp8_latent.write_v4(pages, values, slots, ((dst, src[:4]),))

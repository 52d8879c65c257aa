"""The V4 decode step's index kernels (stages/kernels/triton_v4_paged_index.py) on CUDA at the
V4-Flash graphs' shapes (window 128, rates 4 and 128, 512 rows of up to 256K tokens): the torch
forms' integers exactly."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import triton_v4_paged_index as kernel
from stages.kernels import v4_paged_index as torch_form

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("rows", [1, 512])
def test_kernels_give_the_torch_forms_integers(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    positions = torch.randint(0, 262144, (rows,), generator=g, device="cuda")
    lengths = (positions + 1).masked_fill(torch.arange(rows, device="cuda") % 7 == 3, 0)
    table_rows = torch.randperm(rows, generator=g, device="cuda")
    tables = torch.randint(0, 100000, (rows, 2048), generator=g, device="cuda").int()
    buffers = (positions, lengths, table_rows, tables)
    for got, want in (
        (kernel.window_index(*buffers, 128, 128), torch_form.window_index(*buffers, 128, 128)),
        *(
            (
                kernel.rate_index(*buffers, 128, 128, rate, most, dense, 99 * 128),
                torch_form.rate_index(*buffers, 128, 128, rate, most, dense, 99 * 128),
            )
            for rate, most, dense in ((4, 65536, False), (128, 2048, True))
        ),  # fmt: skip
    ):
        for name, a, b in zip(want._fields, got, want):
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("rows", [1, 512])
def test_pick_slots_gives_the_torch_forms_integers(rows):
    """A CSA layer's picks (index_topk 512 of a 256K row's 64K entries, -1: none) -> slots."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    table = torch.randint(0, 1 << 30, (rows, 65536), generator=g, device="cuda")
    picked = torch.randint(-1, 65536, (rows, 512), generator=g, device="cuda")
    picked[0, 256:] = -1
    visible = torch.randint(0, 65537, (rows,), generator=g, device="cuda")
    (got, counts), (want, want_counts) = (
        f.pick_slots(picked, table, visible) for f in (kernel, torch_form)
    )
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(counts, want_counts)

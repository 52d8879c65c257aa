"""The index arithmetic of a DeepSeek-V4 decode step on its graphs' static buffers
(stages/kernels/v4_paged_index.py): the Triton kernels under Triton's CPU interpreter give the
torch forms' integers exactly, over rows on both sides of the window and of each rate's group
boundary, padding rows of length 0, scattered block tables, rows past their table, and rates
whose groups span blocks (tests/cpu/test_deepseek_v4_paged_decode.py holds the plan built from
the torch forms to the general path)."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import v4_paged_index as torch_form


def _buffers(seed: int):
    g = torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 3, 7, 8, 126, 127, 128, 300, 0, 511])
    lengths = positions + 1
    lengths[8] = 0  # a padding row
    table_rows = torch.randperm(12, generator=g)[: positions.shape[0]]
    block_tables = torch.randperm(64, generator=g)[:48].view(12, 4).int()
    return positions, lengths, table_rows, block_tables


@pytest.mark.parametrize("window", [8, 128, 5])
def test_interpreted_window_index_is_the_torch_forms(triton_interpreter, window):
    from stages.kernels import triton_v4_paged_index as kernel

    buffers = _buffers(window)
    want = torch_form.window_index(*buffers, 128, window)
    got = kernel.launch_window(*buffers, 128, window)
    for name, a, b in zip(want._fields, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize(
    "rate,most,dense", [(4, 40, False), (128, 4, True), (8, 70, True), (2, 3, False)]
)
def test_interpreted_rate_index_is_the_torch_forms(triton_interpreter, rate, most, dense):
    from stages.kernels import triton_v4_paged_index as kernel

    buffers = _buffers(rate + most)
    args = (*buffers, 128, 8, rate, most, dense, 63 * 128)
    want = torch_form.rate_index(*args)
    got = kernel.launch_rate(*args)
    stepped = kernel.launch_rate(*args, entries_a_step=16)  # several steps along a row
    for a, b in zip(stepped, got):
        assert (a is None and b is None) or torch.equal(a, b)
    for name, a, b in zip(want._fields, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_triton_backend_off_cuda_is_a_counted_fallback():
    pytest.importorskip("triton")
    from stages.kernels import triton_v4_paged_index as kernel
    from stages.kernels.fallbacks import FALLBACKS

    FALLBACKS.reset()
    buffers = _buffers(0)
    got = kernel.rate_index(*buffers, 128, 8, 4, 40, True, 63 * 128)
    want = torch_form.rate_index(*buffers, 128, 8, 4, 40, True, 63 * 128)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert FALLBACKS.counts() == {("v4_rate_index", "triton", "device"): 1}
    FALLBACKS.reset()


@pytest.mark.parametrize("k", [4, 7, 512])
def test_interpreted_pick_slots_is_the_torch_form(triton_interpreter, k):
    """A CSA decode row's picks (entry ids, -1: none, anywhere in the row; some past what the
    row sees) -> their slots, -1 for none and for the unseen."""
    from stages.kernels import triton_v4_paged_index as kernel

    g = torch.Generator().manual_seed(k)
    rows, entries = 5, 600
    table = torch.randperm(10_000, generator=g)[: rows * entries].view(rows, entries)
    picked = torch.randint(-1, entries, (rows, k), generator=g)
    picked[1] = -1  # a row with no entry yet
    picked[2, : k // 2] = -1
    visible = torch.tensor([600, 0, 599, 300, 1])
    want, want_counts = torch_form.pick_slots(picked, table, visible)
    got, counts = kernel.launch_pick_slots(picked, table, visible)
    assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)
    assert counts.dtype == torch.int32 and torch.equal(counts, want_counts)
    assert torch.equal(counts, (want >= 0).sum(dim=1, dtype=torch.int32))
    assert torch.equal(want[1], torch.full((k,), -1, dtype=torch.int32))
    unseen = picked >= visible[:, None]
    assert unseen.any() and (want[unseen] == -1).all()
    seen = (picked >= 0) & ~unseen
    assert torch.equal(want[seen], table.gather(1, picked.clamp(min=0))[seen].int())

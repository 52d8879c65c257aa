"""The group_pool op (DeepSeek-V4's compression of a group of tokens into one entry): its torch
form against the pooling written out token by token, `live` groups, and the Triton kernel under
Triton's CPU interpreter against the torch form (tests/gpu/test_group_pool_cuda.py holds it to
the same on CUDA)."""

from __future__ import annotations

import logging

import pytest
import torch

from stages.kernels import group_pool as torch_form
from stages.kernels.fallbacks import FALLBACKS

# (rate, overlap, w): V4's CSA compressor and indexer, its HCA compressor (narrowed), the tiny
# checkpoints' rates
CASES = [
    (4, True, 64),
    (4, True, 16),
    (128, False, 32),
    (2, True, 24),
    (16, False, 40),
    (8, False, 8),
]


def _problem(rate: int, overlap: bool, w: int, groups: int, dtype: torch.dtype, seed: int = 0):
    """A cache component of token rows, each group's 2 * rate token slots (scattered, as a block
    table leaves them), group 0 first, and the fp32 bias."""
    gen = torch.Generator().manual_seed(seed)
    series = 2 if overlap else 1
    slots_total = 4 * groups * rate + 8
    inputs = (torch.randn(slots_total, 2 * series * w, generator=gen) * 2).to(dtype)
    slots = torch.randperm(slots_total, generator=gen)[: groups * 2 * rate].view(groups, 2 * rate)
    first = torch.zeros(groups, dtype=torch.bool)
    first[0] = True
    bias = torch.randn(rate, series * w, generator=gen)
    return inputs, slots, first, bias


def _written_out(inputs, slots, first, bias, rate, overlap):
    """Entry g channel c, token by token in float64: the softmax over the group's slots of
    gate + bias weighting kv."""
    series = 2 if overlap else 1
    w = inputs.shape[-1] // (2 * series)
    x, b = inputs.double(), bias.double()
    out = torch.zeros(slots.shape[0], w, dtype=torch.float64)
    for g in range(slots.shape[0]):
        kvs, gates = [], []
        for j in range(2 * rate):
            if j < rate and (not overlap or bool(first[g])):
                continue  # group g - 1's half: not read without overlap, empty before group 0
            s = x[int(slots[g, j])]
            half = 1 if (overlap and j >= rate) else 0
            kvs.append(s[half * w : (half + 1) * w])
            gates.append(
                s[series * w + half * w : series * w + (half + 1) * w]
                + b[j % rate, half * w : (half + 1) * w]
            )
        weights = torch.stack(gates).softmax(dim=0)
        out[g] = (torch.stack(kvs) * weights).sum(dim=0)
    return out


@pytest.mark.parametrize("rate,overlap,w", CASES)
def test_torch_form_is_the_pooling_written_out(rate, overlap, w):
    inputs, slots, first, bias = _problem(rate, overlap, w, groups=3, dtype=torch.float32)
    got = torch_form.pool_groups(inputs, slots, first, bias, rate, overlap)
    assert got.shape == (3, w) and got.dtype == torch.float32
    want = _written_out(inputs, slots, first, bias, rate, overlap)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_live_groups_keep_their_entries_and_the_others_are_zero():
    inputs, slots, first, bias = _problem(4, True, 16, groups=5, dtype=torch.bfloat16)
    live = torch.tensor([True, False, True, False, False])
    every = torch_form.pool_groups(inputs, slots, first, bias, 4, True)
    got = torch_form.pool_groups(inputs, slots, first, bias, 4, True, live)
    assert torch.equal(got[live], every[live])
    assert not got[~live].any() and every[~live].any()


def test_triton_backend_off_cuda_is_a_counted_fallback(caplog):
    pytest.importorskip("triton")
    from stages.kernels import triton_group_pool

    FALLBACKS.reset()
    inputs, slots, first, bias = _problem(4, True, 16, groups=2, dtype=torch.bfloat16)
    want = torch_form.pool_groups(inputs, slots, first, bias, 4, True)
    with caplog.at_level(logging.WARNING, logger="stages.kernels.fallbacks"):
        got = triton_group_pool.pool_groups(inputs, slots, first, bias, 4, True)
    assert torch.equal(got, want)
    assert FALLBACKS.counts() == {("group_pool", "triton", "device"): 1}
    assert "group_pool on triton (device" in caplog.text
    FALLBACKS.reset()


@pytest.mark.parametrize("rate,overlap,w", CASES)
@pytest.mark.parametrize("live", [False, True])
def test_interpreted_kernel_matches_the_torch_form(triton_interpreter, rate, overlap, w, live):
    from stages.kernels import triton_group_pool

    inputs, slots, first, bias = _problem(
        rate, overlap, w, groups=4, dtype=torch.bfloat16, seed=rate
    )
    alive = torch.tensor([True, False, True, True]) if live else None
    want = torch_form.pool_groups(inputs, slots, first, bias, rate, overlap, alive)
    got = triton_group_pool.launch(inputs, slots, first, bias, rate, overlap, alive)
    assert got.shape == want.shape and got.dtype == want.dtype
    # only the sums' order differs: within one bf16 unit, rarely
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-9)
    assert (got != want).float().mean() < 0.05
    if live:
        assert not got[1].any()


@pytest.mark.parametrize("tile", [256, 4096])
def test_interpreted_kernel_in_fp32_and_channel_blocks(triton_interpreter, tile):
    """fp32 inputs (no rounding between the steps) and a width split over several programs."""
    from stages.kernels import triton_group_pool

    inputs, slots, first, bias = _problem(4, True, 48, groups=3, dtype=torch.float32, seed=7)
    want = torch_form.pool_groups(inputs, slots, first, bias, 4, True)
    got = triton_group_pool.launch(inputs, slots, first, bias, 4, True, tile=tile)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

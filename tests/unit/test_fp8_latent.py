"""The 656-byte FP8 latent layout: exact rope, power-of-two tile scales, e4m3 precision."""

from __future__ import annotations

import torch

from stages.kernels import fp8_latent


def test_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    packed = fp8_latent.quantize(x)
    assert packed.shape == (37, 656) and packed.dtype == torch.uint8
    back = fp8_latent.dequantize(packed)
    assert torch.equal(back[:, 512:], x[:, 512:].bfloat16())  # rope kept in bf16
    tiles = x[:, :512].view(37, 4, 128)
    err = (back[:, :512].float().view(37, 4, 128) - tiles).abs()
    # e4m3 keeps 3 mantissa bits: half a unit in the last place is 1/16 of the value's binade,
    # and no value exceeds its tile's max.
    assert (err <= tiles.abs().amax(-1, keepdim=True) / 16 + 1e-6).all()
    assert (err <= tiles.abs() / 16 + tiles.abs().amax(-1, keepdim=True) * 2**-9).all()


def test_scales_are_powers_of_two_and_bound_the_tile():
    x = torch.zeros(2, 576)
    x[0, :128] = 3.0
    x[1, 128:256] = -1024.0  # 256 * 4: exact in e4m3 after a power-of-two scale
    packed = fp8_latent.quantize(x)
    scale = packed[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    assert (x[:, :512].abs().view(2, 4, 128).amax(-1) / scale <= fp8_latent.FP8_MAX).all()
    assert torch.equal(fp8_latent.dequantize(packed).float(), x)

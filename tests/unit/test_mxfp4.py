"""MXFP4 (DeepSeek-V4's routed experts, dequantized at load): the dequantizer against a per-element
decoding of the OCP format, and a quantize / dequantize round trip within e2m1's precision."""

from __future__ import annotations

import torch

from stages.kernels import mxfp4


def decode_one(code: int, scale_byte: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1)  # e2m1, bias 1
    return sign * mag * 2.0 ** (scale_byte - 127)


def test_dequantize_matches_the_format():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 32), generator=g, dtype=torch.uint8)  # K = 64
    scale = torch.randint(120, 135, (3, 2), generator=g, dtype=torch.uint8)
    out = mxfp4.dequantize(packed, scale)
    for r in range(3):
        for i in range(64):
            byte = int(packed[r, i // 2])
            code = byte & 0xF if i % 2 == 0 else byte >> 4
            assert out[r, i].item() == decode_one(code, int(scale[r, i // 32]))
    e8m0 = scale.view(torch.float8_e8m0fnu)  # the checkpoint's dtype reads the same
    assert torch.equal(mxfp4.dequantize(packed.view(torch.int8), e8m0), out)


def test_round_trip_within_e2m1_precision():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 8, 128, generator=g) * torch.logspace(-4, 2, 8)[None, :, None]
    packed, scale = mxfp4.quantize(w)
    assert packed.shape == (2, 8, 64) and scale.shape == (2, 8, 4)
    back = mxfp4.dequantize(packed, scale)
    groups = w.unflatten(-1, (4, 32))
    step = torch.exp2(scale.float() - 127)[..., None]  # the spacing of codes 4..6 is 2 x this
    err = (back.unflatten(-1, (4, 32)) - groups).abs()
    # nearest code: within half the local spacing (one scale unit in the top binade); the
    # group's max lands in [4, 8) x scale and saturates at 6 x scale, as the OCP scale rule does
    inside = groups.abs() <= 6 * step
    assert (err[inside] <= step.expand_as(err)[inside] + 1e-12).all()
    assert (err <= 2 * step).all() and (groups.abs().amax(-1) < 8 * step[..., 0]).all()
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(back)), back)  # codes are fixed points

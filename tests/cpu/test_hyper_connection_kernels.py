"""DeepSeek-V4's hyper-connection mix (stages/kernels/triton_hyper.py) under Triton's CPU
interpreter against its torch form (stages/kernels/hyper_connection.py), with fp32 products
("ieee"), and with the block's input norm folded into its last kernel (tests/gpu/
test_triton_hyper.py holds both precisions to the same on CUDA)."""

from __future__ import annotations

import pytest
import torch

from stages.kernels import hyper_connection


def _inputs(t: int, n: int, d: int):
    g = torch.Generator().manual_seed(t + d)
    streams = torch.randn(t, n, d, generator=g).bfloat16()
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.01
    base = torch.randn((2 + n) * n, generator=g) * 0.1
    return streams, fn, base, torch.rand(3, generator=g) + 0.5


# whole rows in a tile, one program a token (the first two); rows wider than a tile, sixteen
# tokens a program a slice at a time, the partial sums of 47 splits four at a time (the third)
@pytest.mark.parametrize("t,n,d", [(5, 4, 256), (17, 2, 384), (18, 2, 9000)])
@pytest.mark.parametrize("normed", [False, True])
def test_interpreted_mix_matches_the_torch_form(triton_interpreter, t, n, d, normed):
    from stages.kernels import triton_hyper

    streams, fn, base, scale = _inputs(t, n, d)
    out_norm = (torch.rand(d, generator=torch.Generator().manual_seed(1)) + 0.5, 1e-6)
    norm = out_norm if normed else None
    want = hyper_connection.mix(streams, fn, base, scale, 3, 1e-6, 1e-6, norm)
    got = triton_hyper.launch_mix(streams, fn, base, scale, 3, 1e-6, 1e-6, norm, "ieee")
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    # the collapse rounded to bf16 from fp32 sums in another order (then normed): a bf16 unit
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2**-7, atol=2**-7)
    if normed:  # the fold is the norm of the kernel's own collapse
        plain = triton_hyper.launch_mix(streams, fn, base, scale, 3, 1e-6, 1e-6, None, "ieee")
        own = hyper_connection.fp32_rms_norm(plain[2], *out_norm)
        torch.testing.assert_close(got[2].float(), own.float(), rtol=2**-7, atol=0)

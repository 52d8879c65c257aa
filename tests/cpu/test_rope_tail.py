"""The rope_tail op (DeepSeek-V4's rope on a head's trailing channels, in place, optionally after
the head's unweighted RMS norm): its torch form against the rotation written as complex
products, and the Triton kernel under Triton's CPU interpreter against the torch form
(tests/gpu/test_triton_rope.py holds it to the same on CUDA)."""

from __future__ import annotations

import logging

import pytest
import torch

from stages.kernels import rope_tail as torch_form
from stages.kernels.fallbacks import FALLBACKS
from stages.kernels.hyper_connection import unweighted_rms_norm

# the norm before the rotation: none, the queries' unweighted one, V4RMSNorm's fp32-weighted one
NORMS = ["none", "unweighted", "weighted"]

# (x's shape, rotated channels): V4's queries and outputs, the indexer's queries, the latent
SHAPES = [((5, 8, 512), 64), ((7, 4, 128), 64), ((9, 512), 64), ((3, 6, 40), 16)]


def _angles(t: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin per channel as deepseek_v4.layers.Angles holds them: (c0, c0, ...),
    (-s0, s0, ...), from bf16-rounded cos / sin as the model's Rotary gives them."""
    theta = torch.rand(t, r // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    cos, sin = theta.cos().bfloat16().float(), theta.sin().bfloat16().float()
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def _x(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _norm(kind: str, d: int) -> tuple[float | None, torch.Tensor | None]:
    """(norm_eps, weight) for rope_tail."""
    if kind == "none":
        return None, None
    weight = torch.rand(d, generator=torch.Generator().manual_seed(d)) + 0.5
    return 1e-6, (weight if kind == "weighted" else None)


def _normed(x: torch.Tensor, kind: str) -> torch.Tensor:
    eps, weight = _norm(kind, x.shape[-1])
    if kind == "none":
        return x.clone()
    if kind == "unweighted":
        return unweighted_rms_norm(x, eps)
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


@pytest.mark.parametrize("shape,r", SHAPES)
@pytest.mark.parametrize("norm", NORMS)
def test_torch_form_is_the_complex_rotation_in_place(shape, r, norm):
    x = _x(shape, seed=r)
    cos, sin = _angles(shape[0], r, seed=1)
    before = _normed(x, norm)
    got = torch_form.rope_tail(x, cos, sin, *_norm(norm, shape[-1]))
    assert got.data_ptr() == x.data_ptr()  # in place
    assert torch.equal(got[..., :-r], before[..., :-r])  # the other channels only normed
    pairs = torch.view_as_complex(before[..., -r:].double().unflatten(-1, (-1, 2)).contiguous())
    turn = torch.complex(cos[:, ::2].double(), sin[:, 1::2].double())
    while turn.dim() < pairs.dim():
        turn = turn.unsqueeze(-2)
    want = torch.view_as_real(pairs * turn).flatten(-2)
    # the fp32 products and sum, rounded once to bf16: within one bf16 unit of the exact value
    torch.testing.assert_close(got[..., -r:].double(), want, rtol=2**-7, atol=1e-6)


def test_triton_backend_off_cuda_is_a_counted_fallback(caplog):
    pytest.importorskip("triton")
    from stages.kernels import triton_rope

    FALLBACKS.reset()
    x = _x((4, 2, 32), seed=0)
    cos, sin = _angles(4, 16, seed=0)
    want = torch_form.rope_tail(x.clone(), cos, sin, 1e-6)
    with caplog.at_level(logging.WARNING, logger="stages.kernels.fallbacks"):
        got = triton_rope.rope_tail(x, cos, sin, 1e-6)
    assert torch.equal(got, want)
    assert FALLBACKS.counts() == {("rope_tail", "triton", "device"): 1}
    assert "rope_tail on triton (device" in caplog.text
    FALLBACKS.reset()


@pytest.mark.parametrize("shape,r", SHAPES)
@pytest.mark.parametrize("norm", NORMS)
def test_interpreted_kernel_matches_the_torch_form(triton_interpreter, shape, r, norm):
    from stages.kernels import triton_rope

    x = _x(shape, seed=len(shape) + r)
    cos, sin = _angles(shape[0], r, seed=2)
    eps, weight = _norm(norm, shape[-1])
    want = torch_form.rope_tail(x.clone(), cos, sin, eps, weight)
    got = triton_rope.launch(x, cos, sin, eps, weight)
    assert got.data_ptr() == x.data_ptr()
    if norm == "none":  # the same fp32 steps: the same bits
        assert torch.equal(got, want)
        return
    # only the sum of squares' order differs: one bf16 unit of a rotation's inputs, rarely
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-4)
    assert (got != want).float().mean() < 0.01


def test_interpreted_kernel_on_strided_heads(triton_interpreter):
    """Heads further apart than their width (a view into a wider buffer) keep the gaps."""
    from stages.kernels import triton_rope

    wide = _x((6, 3, 80), seed=5)
    x = wide[:, :, :64]
    cos, sin = _angles(6, 32, seed=3)
    want = torch_form.rope_tail(x.clone(), cos, sin, 1e-6)
    gaps = wide[:, :, 64:].clone()
    triton_rope.launch(x, cos, sin, 1e-6)
    torch.testing.assert_close(x.float(), want.float(), rtol=2**-7, atol=0)
    assert torch.equal(wide[:, :, 64:], gaps)


@pytest.mark.parametrize("shape", [(5, 4096), (3, 2, 1024), (7, 40)])
def test_interpreted_rms_norm_matches_the_torch_form(triton_interpreter, shape):
    """rms_norm_fp32 (V4RMSNorm without a rotation): the kernel against fp32_rms_norm."""
    from stages.kernels import triton_rope

    x = _x(shape, seed=shape[-1])
    weight = torch.rand(shape[-1], generator=torch.Generator().manual_seed(1)) + 0.5
    want = torch_form.fp32_rms_norm(x, weight, 1e-6)
    got = triton_rope.launch_rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    assert (got != want).float().mean() < 0.01


def test_rms_norm_off_cuda_is_a_counted_fallback():
    pytest.importorskip("triton")
    from stages.kernels import triton_rope

    FALLBACKS.reset()
    x, weight = _x((4, 64), seed=0), torch.rand(64) + 0.5
    assert torch.equal(
        triton_rope.rms_norm(x, weight, 1e-6), torch_form.fp32_rms_norm(x, weight, 1e-6)
    )
    assert FALLBACKS.counts() == {("rms_norm_fp32", "triton", "device"): 1}
    FALLBACKS.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_angles_match_the_torch_form(triton_interpreter, dtype):
    """rope_angles: the kernel's cos / signed sin per channel against the torch form's, at
    positions up to 1M (numpy's cos / sin against torch's: an fp32 ulp apart, which rounding to
    bf16 hides but rarely)."""
    from stages.kernels import rope_tail as torch_form
    from stages.kernels import triton_rope

    positions = torch.tensor([0, 1, 7, 4096, 65535, 262143, 1048575, 12])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    want = torch_form.rope_angles(positions, inv_freq, 0.75, dtype)
    got = triton_rope.launch_angles(positions, inv_freq, 0.75, dtype)
    for a, b in zip(got, want):
        assert a.shape == b.shape == (8, 64) and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=0)
        if dtype == torch.bfloat16:
            assert (a != b).float().mean() < 0.02

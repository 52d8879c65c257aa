"""DeepSeek-V4's rope on the trailing channels, in place (the `rope_tail` op's torch form):
optionally the head's RMS norm first, unweighted (hyper_connection.unweighted_rms_norm's steps:
the queries) or with an fp32 weight (`fp32_rms_norm`, V4RMSNorm's: the latent and the
compressed entries), then the last r channels of x [T, ..., D] rotated in interleaved pairs
(x0, x1), (x2, x3), ... in fp32 and cast back: (x0 c - x1 s, x1 c + x0 s). cos / sin come per
channel, [T, r] fp32: (c0, c0, c1, c1, ...) and (-s0, s0, -s1, s1, ...)
(deepseek_v4.layers.Angles). In place, because V4 rotates its queries, keys and attention
outputs right after making them: the composite's full copy of a [8192, 64, 512] query per layer
was most of its cost."""

from __future__ import annotations

import torch

from stages.kernels.hyper_connection import fp32_rms_norm, unweighted_rms_norm

__all__ = ["fp32_rms_norm", "rope_angles", "rope_tail"]  # fp32_rms_norm: rms_norm_fp32's form


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rope_angles` op's torch form: (cos, signed sin) [N, r] fp32 per channel, as
    rope_tail takes them, of a rotary with inv_freq [r / 2] at positions [N]: cos and sin of
    position x inv_freq in fp32, times the (yarn) scaling, rounded to the model's dtype as
    transformers casts them."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos = (freqs.cos() * scaling).to(dtype).float()
    sin = (freqs.sin() * scaling).to(dtype).float()
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def rope_tail(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_eps: float | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, ..., D] normed (norm_eps given; with weight [D] fp32, weighted) and rotated in
    place; returns x."""
    if norm_eps is not None:
        if weight is None:
            x.copy_(unweighted_rms_norm(x, norm_eps))
        else:
            x.copy_(fp32_rms_norm(x, weight, norm_eps))
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    width = cos.shape[-1]
    rope = x[..., -width:].float()
    swapped = rope.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    x[..., -width:] = rope * cos + swapped * sin  # cast to x's dtype by the copy
    return x

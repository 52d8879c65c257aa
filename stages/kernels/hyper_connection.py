"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), op for op as transformers: the
torch reference of the `hc_mix` and `hc_merge` ops (stages/kernels/registry.py).

`mix`: from the hc_mult residual streams [T, N, D], the RMS-normalised fp32 projection of all
streams gives per token `pre` (how the streams collapse into the block's input), `post` (how the
block's output spreads back) and `comb` (how the streams recombine: a softmax, then Sinkhorn
normalisation of rows and columns). `merge`: the block's output spread by `post` plus the streams
mixed by comb^T, in the streams' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def fp32_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's RMSNorm: the product with its fp32 weight taken in fp32, cast once.
    torch's rms_norm: the same ops on the CPU (bit for bit), one fused kernel on CUDA."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    out_norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D]; fn [(2 + N) N, N D], base [(2 + N) N], scale [3], all fp32 ->
    (post [T, N] fp32, comb [T, N, N] fp32, the collapsed block input [T, D] in streams' dtype).
    out_norm (weight [D] fp32, eps): the block's input norm (V4RMSNorm) applied to it."""
    n = streams.shape[1]
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    pre_w, post_w, comb_w = torch.split(F.linear(flat, fn), [n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = torch.split(base, [n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1)
    comb.add_(eps)
    # Sinkhorn in place (the same ops as out of place): one temporary per normalisation
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    if out_norm is not None:
        collapsed = fp32_rms_norm(collapsed, *out_norm)
    return post, comb, collapsed


def merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """streams [T, N, D], the block's output [T, D], post [T, N], comb [T, N, N] -> [T, N, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )

"""DeepSeek-V4's small pieces, op for op as transformers: fp32-weight RMSNorms, interleaved
partial RoPE on the trailing channels, the two rotaries, and manifold-constrained
hyper-connections (Sinkhorn-mixed residual streams) with the head's final collapse."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stages.kernels.hyper_connection import unweighted_rms_norm
from stages.kernels.registry import Kernels
from stages.kernels.rope_tail import fp32_rms_norm
from stages.models.deepseek_v4.config import RopeArgs, V4Args
from stages.models.layers import RMSNorm
from stages.models.mla import yarn_inv_freq


class V4RMSNorm(RMSNorm):
    """The shared RMSNorm with V4's precision: the weight kept in fp32, the product taken in
    fp32 and cast once (rope_tail.fp32_rms_norm); on the kernels' rms_norm_fp32 when given."""

    def __init__(
        self, dim: int, eps: float, device: str | torch.device, kernels: Kernels | None = None
    ):
        super().__init__(dim, eps, torch.float32, device)
        self._norm = fp32_rms_norm
        if kernels is not None and kernels.rms_norm_fp32 is not None:
            self._norm = kernels.rms_norm_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._norm(x, self.weight, self.eps)
        return out


class Rotary(nn.Module):
    """A rotary's angles at positions (kernels.rope_angles), cos / sin in the model's dtype as
    transformers casts them."""

    inv_freq: torch.Tensor

    def __init__(self, a: V4Args, rope: RopeArgs, kernels: Kernels, device: str | torch.device):
        super().__init__()
        dim = a.rope_dim
        if rope.yarn is None:
            inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.scaling = 1.0
        else:
            inv, self.scaling = yarn_inv_freq(dim, rope.theta, rope.yarn)
        self.register_buffer("inv_freq", inv.to(device), persistent=False)
        if kernels.rope_angles is None:
            raise RuntimeError("DeepSeek-V4 layers need kernels.rope_angles, unset here")
        self._angles = kernels.rope_angles

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        cos, sin = self._angles(positions, self.inv_freq, self.scaling, dtype)
        return Angles(cos, sin)


@dataclass(frozen=True)
class Angles:
    """One rotary at N positions as apply_rope takes it, from its model-dtype cos / sin
    [N, r / 2] in fp32: cos per channel [N, r] (c0, c0, c1, c1, ...) and sin signed per channel
    (-s0, s0, -s1, s1, ...), so a pair (x0, x1) turns into x * cos + (x1, x0) * sin."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(frozen=True)
class ForwardAngles:
    """One rotary's angles that a forward's layers share, each computed once per forward."""

    tokens: Angles  # at the tokens' positions
    inverse: Angles  # the same, rotating back (the attention output's rope channels)
    groups: dict[int, Angles]  # per rate: at the positions of the groups the forward completes

    @classmethod
    def build(
        cls,
        rotary: Rotary,
        positions: torch.Tensor,
        group_positions: dict[int, torch.Tensor],
        dtype: torch.dtype,
    ) -> ForwardAngles:
        tokens = rotary.angles(positions, dtype)
        return cls(
            tokens,
            Angles(tokens.cos, -tokens.sin),
            {rate: rotary.angles(p, dtype) for rate, p in group_positions.items()},
        )


def apply_rope(
    x: torch.Tensor,
    angles: Angles,
    kernels: Kernels,
    norm_eps: float | None = None,
    norm: V4RMSNorm | None = None,
) -> torch.Tensor:
    """x [T, ..., D] rotated in place on its trailing r channels in interleaved pairs (V4's K is
    also its V, so the layout is kept), after the head's RMS norm: unweighted with norm_eps
    (the queries), or `norm`'s (the latent, the compressed entries): the rope_tail op
    (stages/kernels/rope_tail.py). x must be the caller's own."""
    if kernels.rope_tail is None:
        raise RuntimeError("DeepSeek-V4 layers need kernels.rope_tail, unset here")
    if norm is not None:
        out: torch.Tensor = kernels.rope_tail(x, angles.cos, angles.sin, norm.eps, norm.weight)
    else:
        out = kernels.rope_tail(x, angles.cos, angles.sin, norm_eps)
    return out


class HyperConnection(nn.Module):
    """One block's mHC: from the hc_mult streams [T, N, D], the block's input (the streams
    collapsed by `pre`), and how the block's output and the streams recombine: `post` [T, N]
    and the Sinkhorn-normalised `comb` [T, N, N] (read transposed). The math is the `hc_mix` /
    `hc_merge` kernel ops (stages/kernels/hyper_connection.py)."""

    def __init__(self, a: V4Args, kernels: Kernels, device: str | torch.device):
        super().__init__()
        n = a.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = (
            n,
            a.hc_sinkhorn_iters,
            a.hc_eps,
            a.rms_norm_eps,
        )
        if kernels.hc_mix is None or kernels.hc_merge is None:
            raise RuntimeError("DeepSeek-V4 layers need kernels.hc_mix and hc_merge, unset here")
        self._mix, self._merge = kernels.hc_mix, kernels.hc_merge
        self.fn = nn.Parameter(
            torch.empty((2 + n) * n, n * a.hidden_size, dtype=torch.float32, device=device)
        )
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32, device=device))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32, device=device))

    def forward(
        self, streams: torch.Tensor, norm: V4RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post, comb, the block's input, normed by `norm` when given: the op folds it in)."""
        out_norm = None if norm is None else (norm.weight, norm.eps)
        mixed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self._mix(
            streams, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps, out_norm
        )
        return mixed

    def merge(
        self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The block's output spread by `post` plus the streams mixed by comb^T."""
        merged: torch.Tensor = self._merge(streams, out, post, comb)
        return merged


class HyperHead(nn.Module):
    """The last collapse of the streams, before the final norm (checkpoint name hc_head)."""

    def __init__(self, a: V4Args, device: str | torch.device):
        super().__init__()
        n = a.hc_mult
        self.eps, self.norm_eps = a.hc_eps, a.rms_norm_eps
        self.hc_fn = nn.Parameter(
            torch.empty(n, n * a.hidden_size, dtype=torch.float32, device=device)
        )
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32, device=device))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32, device=device))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

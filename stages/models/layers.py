"""Layers every model family shares: RMSNorm, Linear (optionally fused from several checkpoint
tensors), rotary embedding helpers, the SwiGLU MLP and the pre-norm residual decoder layer.

The math follows Hugging Face transformers op for op (fp32 RMSNorm, rotate_half RoPE, SiLU-gated
MLP), so a stage's logits match the checkpoint's own model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stages.kernels.fp8_ref import BLOCK as FP8_BLOCK
from stages.kernels.fp8_ref import FP8
from stages.kernels.registry import Kernels
from stages.kernels.torch_ref import swiglu
from stages.model_config import ModelArgs

# Parameter -> (checkpoint tensor, index into the parameter) of each piece it is loaded from.
Sources = dict[str, list[tuple[str, tuple[Any, ...]]]]
Device = str | torch.device


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """HF's inv_freq in fp32 over head_dim, including llama3 frequency scaling."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate x [..., D] by angles whose cos/sin are [..., D/2]. Interleaved checkpoints pair
    (x0, x1), (x2, x3)...; others pair the two halves. Either way the result is laid out as
    [rotated firsts, rotated seconds]; q and k share the layout, so their dot products are the
    checkpoint's."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: Device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Linear(nn.Module):
    """Holds a checkpoint's weight (and bias); the matmul runs on the chosen kernel backend.

    When FP8 weights stay FP8 (`kernels.fp8_linear` set) and `fp8` is not turned off, the weight
    is float8_e4m3fn [N, K] with its `weight_scale_inv` [N/128, K/128] (the checkpoint's names)
    and the matmul is W8A8; a fused weight whose parts are not 128-row aligned stays in `dtype`.
    """

    def __init__(
        self,
        n_in: int,
        n_out: int,
        bias: bool,
        kernels: Kernels,
        dtype: torch.dtype,
        device: Device,
        parts: tuple[tuple[str, int], ...] = (),
        fp8: bool = True,
    ):
        super().__init__()
        # A fused weight: (checkpoint module name, rows) of each tensor it concatenates.
        self.parts = parts
        self.fp8 = (
            fp8
            and kernels.fp8_linear is not None
            and all(rows % FP8_BLOCK == 0 for _, rows in parts)
        )
        self.weight = nn.Parameter(
            torch.empty(n_out, n_in, dtype=FP8 if self.fp8 else dtype, device=device)
        )
        self.weight_scale_inv = (
            nn.Parameter(
                torch.empty(
                    -(-n_out // FP8_BLOCK),
                    -(-n_in // FP8_BLOCK),
                    dtype=torch.float32,
                    device=device,
                )
            )
            if self.fp8
            else None
        )
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype, device=device)) if bias else None
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            fp8_linear = self.kernels.fp8_linear
            if fp8_linear is None:
                raise RuntimeError("FP8 weights need kernels.fp8_linear, which is unset")
            fp8: torch.Tensor = fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)
            return fp8
        out: torch.Tensor = self.kernels.linear(x, self.weight, self.bias)
        return out

    def checkpoint_sources(self, name: str) -> Sources:
        """A fused weight's pieces: the rows each sibling tensor of `name` fills."""
        owner = name.rpartition(".")[0]
        out: Sources = {}
        for leaf in ("weight", "bias", "weight_scale_inv") if self.parts else ():
            if getattr(self, leaf) is None:
                continue
            per_row = FP8_BLOCK if leaf == "weight_scale_inv" else 1  # a scale per 128 rows
            pieces, row = [], 0
            for part, rows in self.parts:
                pieces.append(
                    (f"{owner}.{part}.{leaf}", (slice(row // per_row, (row + rows) // per_row),))
                )
                row += rows
            out[leaf] = pieces
        return out


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one GEMM (the loader concatenates the
    checkpoint's gate_proj and up_proj); `limit` clamps both first (DeepSeek-V4)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        bias: bool,
        kernels: Kernels,
        dtype: torch.dtype,
        device: Device,
        limit: float | None = None,
    ):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = Linear(
            hidden,
            2 * inter,
            bias,
            kernels,
            dtype,
            device,
            (("gate_proj", inter), ("up_proj", inter)),
        )
        self.down_proj = Linear(inter, hidden, bias, kernels, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(swiglu(gate, up, self.limit))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: h + attn(norm(h)), then h + mlp(norm(h)). The attention takes the
    stage's per-forward context (rope tables, row metadata), the batch, the cache and its local
    layer index."""

    def __init__(
        self,
        args: ModelArgs,
        self_attn: nn.Module,
        mlp: nn.Module,
        dtype: torch.dtype,
        device: Device,
    ):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)

    def forward(
        self, h: torch.Tensor, context: tuple[Any, ...], batch: Any, kv: Any, local_layer: int
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), *context, batch, kv, local_layer)
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out

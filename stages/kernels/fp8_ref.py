"""Block-scaled FP8 (DeepSeek's checkpoint format) and W8A8 linears: the torch reference.

Weights are float8_e4m3fn [N, K] with one fp32 `weight_scale_inv` per 128 x 128 tile (the value
is fp8 * scale); activations are quantized on the fly in 1 x 128 groups along K, one fp32 scale
per row and group. A W8A8 linear is the matmul of the two dequantized operands, which is what
every GPU backend (stages/kernels/fp8_gemm.py) is tested against and what CPU runs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from stages.kernels import torch_ref

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # the weight tile and activation group the W8A8 kernels support
MIN_SCALE = 1e-12  # an all-zero tile or group keeps a finite scale
SCALE_SUFFIX = "_scale_inv"  # a kept-FP8 parameter's scales: `<parameter>_scale_inv`


def scale_index(index: tuple[Any, ...]) -> tuple[Any, ...]:
    """A weight piece's index -> its scales' (row slices counted in 128-row tiles)."""
    return tuple(
        slice(i.start // BLOCK, i.stop // BLOCK) if isinstance(i, slice) else i for i in index
    )


def is_available(device: str) -> bool:
    return True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_weight(
    w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float) -> (fp8 [..., N, K], scale_inv [..., cdiv(N, b0), cdiv(K, b1)]
    fp32): each tile's largest magnitude maps to e4m3's 448."""
    *lead, n, k = w.shape
    b0, b1 = block
    rows, cols = _cdiv(n, b0), _cdiv(k, b1)
    padded = F.pad(w.float(), (0, cols * b1 - k, 0, rows * b0 - n))
    tiles = padded.view(*lead, rows, b0, cols, b1)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp_min(MIN_SCALE) / FP8_MAX  # [..., rows, cols]
    q = (tiles / scale[..., :, None, :, None]).view(*lead, rows * b0, cols * b1)
    return q[..., :n, :k].to(FP8).contiguous(), scale.contiguous()


def dequantize_weight(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
) -> torch.Tensor:
    """Block-scaled FP8 [..., N, K] -> fp32."""
    n, k = w.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], -2)[..., :n, :]
    scale = scale.repeat_interleave(block[1], -1)[..., :k]
    return w.float() * scale


def quantize_act(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale [M, cdiv(K, group)] fp32), one scale per 1 x group.
    The scale is the group's largest magnitude times the float32 reciprocal of 448 (what
    CUDA's division by a scalar computes; said explicitly, the CPU computes the same bits)."""
    m, k = x.shape
    groups = _cdiv(k, group)
    g = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = g.abs().amax(dim=-1).clamp_min(MIN_SCALE) * (1 / FP8_MAX)
    q = (g / scale[..., None]).view(m, groups * group)[:, :k]
    return q.to(FP8).contiguous(), scale


def dequantize_act(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group, -1)[..., :k]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 `x @ dequant(weight).T + bias`: x [..., K] quantized in 1 x 128 groups, weight
    [N, K] fp8 with 128 x 128 scales; fp32 accumulation, result in x's dtype."""
    k = x.shape[-1]
    q, s = quantize_act(x.reshape(-1, k))
    out = dequantize_act(q, s) @ dequantize_weight(weight, scale_inv).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def swiglu_linear(
    gate_up: torch.Tensor,
    limit: float | None,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear(torch_ref.swiglu(gate, up, limit), weight, scale_inv, bias) of gate_up [..., 2I]
    (gate | up): a SwiGLU's W8A8 down projection (the fp8_swiglu_linear op)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return linear(torch_ref.swiglu(gate, up, limit), weight, scale_inv, bias)


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fp8_linear: Callable[..., torch.Tensor] = linear,
    limit: float | None = None,
) -> torch.Tensor:
    """Routed experts with FP8 weights (gate_up [E, 2I, H], down [E, H, I], their 128 x 128
    scales [E, ...]): torch_ref.moe_experts with each expert's GEMMs on `fp8_linear` (W8A8);
    limit: DeepSeek-V4's swiglu clamp, as torch_ref.swiglu."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = fp8_linear(rows, gate_up[e], gate_up_scale[e]).chunk(2, dim=-1)
        return fp8_linear(torch_ref.swiglu(gate, up, limit), down[e], down_scale[e])

    return torch_ref.per_expert(x, topk_ids, topk_weights, gate_up.shape[0], expert)

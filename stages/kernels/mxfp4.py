"""MXFP4 (OCP microscaling FP4), the format of DeepSeek-V4's routed experts: e2m1 values packed
two per byte (element 2i in the low nibble), one e8m0 scale (a power of two, 2^(byte - 127)) per
32 consecutive values along K. The loader (stages/loader.py) keeps them packed (the experts run
W4A16: stages.kernels.triton_moe_mxfp4 dequantizes in the kernel) or, with
`--mxfp4-experts dequantize`, widens them to the model's dtype at load, recognising them from
the tensors themselves. Here: the dequantizer, the recognition, the reference quantizer and the
reference experts (`moe_experts`, the registry's torch backend of moe_experts_mxfp4).
"""

from __future__ import annotations

import torch

from stages.kernels import torch_ref

GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0-7; bit 3 is sign
E8M0_BIAS = 127
# How a checkpoint stores the packed nibbles: transformers writes int8, or float4_e2m1fn_x2
PACKED_DTYPES = tuple(
    getattr(torch, name) for name in ("int8", "uint8", "float4_e2m1fn_x2") if hasattr(torch, name)
)


def _values(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(E2M1, dtype=torch.float32, device=device)
    return torch.cat((mags, -mags))  # code -> value


def is_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `packed` with `scale` is MXFP4, from the tensors as transformers tells (the block
    derived from the scale's grid): a packed dtype, K halved, one scale per row per 32 values."""
    return (
        packed.dtype in PACKED_DTYPES
        and packed.dim() == scale.dim()
        and tuple(scale.shape[:-1]) == tuple(packed.shape[:-1])
        and scale.shape[-1] * GROUP == 2 * packed.shape[-1]
    )


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [..., K/2] uint8 (or int8), scale [..., K/32] e8m0 (float8_e8m0fnu or its uint8
    bytes) -> fp32 [..., K]."""
    codes = packed.contiguous().view(torch.uint8).long()
    both = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)  # [..., K]
    values = _values(packed.device)[both]
    exponent = scale.contiguous().view(torch.uint8).float() - E8M0_BIAS
    return values * torch.exp2(exponent).repeat_interleave(GROUP, dim=-1)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (packed uint8 [..., K/2], scale uint8 [..., K/32]):
    each group's scale is the power of two putting its largest magnitude in e2m1's top binade
    (4..6), each value the nearest code."""
    k = w.shape[-1]
    if k % GROUP:
        raise ValueError(f"MXFP4 groups {GROUP} values along K; K = {k}")
    g = w.float().reshape(*w.shape[:-1], k // GROUP, GROUP)
    amax = g.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = (g / torch.exp2(exponent)[..., None]).flatten(-2)
    # the nearest magnitude (ties: the lower code), by the midpoints between E2M1's magnitudes
    mags = torch.tensor(E2M1, dtype=torch.float32, device=w.device)
    codes = torch.bucketize(scaled.abs(), (mags[1:] + mags[:-1]) / 2)
    codes = torch.where((scaled < 0) & (codes > 0), codes | 8, codes)
    pairs = codes.reshape(*codes.shape[:-1], k // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """Routed experts with MXFP4 weights: gate_up [E, 2I, H/2] uint8 with scales [E, 2I, H/32],
    down [E, H, I/2] with [E, H, I/32]; torch_ref.moe_experts on each expert's weights
    dequantized to x's dtype when it has rows (limit: DeepSeek-V4's swiglu clamp)."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gu = dequantize(gate_up[e], gate_up_scale[e]).to(x.dtype)
        gate, up = torch.nn.functional.linear(rows, gu).chunk(2, dim=-1)
        d = dequantize(down[e], down_scale[e]).to(x.dtype)
        return torch.nn.functional.linear(torch_ref.swiglu(gate, up, limit), d)

    return torch_ref.per_expert(x, topk_ids, topk_weights, gate_up.shape[0], expert)

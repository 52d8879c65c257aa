"""DeepSeek-V3.2's FP8 latent layout (656 bytes per token), the one FlashMLA's SM90 sparse
decode reads: the 512 no-rope values as float8_e4m3 in 4 tiles of 128, each tile's float32
scale (a power of two: exact to apply), then the 64 rope values kept in bf16.

Values are scaled so each tile's largest magnitude maps to e4m3's 448.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.kernels import torch_ref

NOPE, ROPE, TILE = 512, 64, 128
TILES = NOPE // TILE
BYTES = NOPE + 4 * TILES + 2 * ROPE  # 656
FP8_MAX = 448.0


def quantize(latent: torch.Tensor) -> torch.Tensor:
    """[T, 576] (any float dtype) -> [T, 656] uint8 in the layout above."""
    if latent.shape[-1] != NOPE + ROPE:
        raise ValueError(
            f"the FP8 layout holds {NOPE + ROPE} values per token, got {latent.shape[-1]}"
        )
    t = latent.shape[0]
    out = torch.empty(t, BYTES, dtype=torch.uint8, device=latent.device)
    nope = latent[:, :NOPE].float().view(t, TILES, TILE)
    scale = pow2_scale(nope.abs().amax(dim=-1))  # [T, TILES]
    out[:, :NOPE] = (
        (nope / scale[..., None]).view(t, NOPE).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    out[:, NOPE : NOPE + 4 * TILES] = scale.contiguous().view(torch.uint8)
    out[:, NOPE + 4 * TILES :] = latent[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The least power of two >= max(amax, 1e-4) / 448 (float32): dividing a tile by it maps
    its largest magnitude into e4m3's range, and applying it back is exact."""
    target = amax.float().clamp_min(1e-4) / FP8_MAX
    mantissa, exponent = torch.frexp(target)  # target = mantissa * 2^exponent, in [0.5, 1)
    # exactly (log2 rounds near powers of two)
    return torch.ldexp(torch.ones_like(target), exponent - (mantissa == 0.5).int())


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """[T, 656] uint8 -> [T, 576] bf16."""
    t = packed.shape[0]
    nope = packed[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().view(t, TILES, TILE)
    scale = packed[:, NOPE : NOPE + 4 * TILES].contiguous().view(torch.float32)
    rope = packed[:, NOPE + 4 * TILES :].contiguous().view(torch.bfloat16)
    return torch.cat(((nope * scale[..., None]).view(t, NOPE).bfloat16(), rope), dim=-1)


def is_available(device: str) -> bool:
    return True


def mla_sparse(
    q: torch.Tensor,
    pages: torch.Tensor,
    indices: torch.Tensor,
    dv: int,
    scale: float,
    state: dict[str, Any],
) -> torch.Tensor:
    """torch_ref.mla_sparse over FP8 latent pages [blocks, B, 1, 656]: only the slots some
    query names are dequantized. -> [T, H, dv] in q's dtype."""
    flat = pages.view(-1, BYTES)
    used = indices >= 0
    slots, local = torch.unique(indices[used].long(), return_inverse=True)
    remapped = torch.full_like(indices, -1)
    remapped[used] = local.to(indices.dtype)
    kv = dequantize(flat.index_select(0, slots)).to(q.dtype)
    return torch_ref.mla_sparse(q, kv.view(-1, 1, NOPE + ROPE), remapped, dv, scale)

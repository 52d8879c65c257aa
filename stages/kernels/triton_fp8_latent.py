"""Quantize-on-write of DeepSeek-V3.2's FP8 latent (stages/kernels/fp8_latent.py's 656-byte
layout) in one Triton kernel: each token's 512 no-rope values in 4 tiles of 128 (largest
magnitude to e4m3's 448 under a power-of-two scale), the scales and the 64 bf16 rope values,
stored straight at the token's cache slot. One program per token.

``write(flat, values, slots)`` matches ``flat.index_copy_(0, slots, fp8_latent.quantize(values))``.
Anything not on CUDA (or without triton) takes that torch path.
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_latent


def write(flat: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """flat [slots, 656] uint8 pages, values [T, 576] (any float), slots [T] long."""
    if triton is None or not flat.is_cuda or values.shape[0] == 0:
        flat.index_copy_(0, slots, fp8_latent.quantize(values))
        return
    v = values.contiguous()
    _quantize_write[(v.shape[0],)](
        v,
        slots.contiguous(),
        flat.view(torch.float8_e4m3fn),
        flat.view(torch.float32),
        flat.view(torch.bfloat16),
        v.stride(0),
        NOPE=fp8_latent.NOPE,
        ROPE=fp8_latent.ROPE,
        TILE=fp8_latent.TILE,
        FP8_MAX=fp8_latent.FP8_MAX,
        num_warps=4,
    )


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit
    def _quantize_write(
        v_ptr,
        slot_ptr,
        q_ptr,
        scale_ptr,
        rope_ptr,
        stride_v,
        NOPE: tl.constexpr,
        ROPE: tl.constexpr,
        TILE: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        tiles: tl.constexpr = NOPE // TILE
        row_bytes: tl.constexpr = NOPE + 4 * tiles + 2 * ROPE
        offs = tl.arange(0, TILE)
        for i in tl.static_range(tiles):
            x = tl.load(v_ptr + t * stride_v + i * TILE + offs).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4) / FP8_MAX
            # the least power of two >= amax, from its bits (exact, as the reference)
            bits = amax.to(tl.int32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (exponent << 23).to(tl.float32, bitcast=True)
            tl.store(q_ptr + slot * row_bytes + i * TILE + offs, (x / scale).to(tl.float8e4nv))
            tl.store(scale_ptr + slot * (row_bytes // 4) + NOPE // 4 + i, scale)
        r = tl.arange(0, ROPE)
        rope = tl.load(v_ptr + t * stride_v + NOPE + r).to(tl.bfloat16)
        tl.store(rope_ptr + slot * (row_bytes // 2) + (NOPE + 4 * tiles) // 2 + r, rope)

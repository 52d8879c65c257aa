"""Quantize-on-write of the FP8 latent layouts in one Triton kernel each, one program per token,
stored straight at the token's cache slot; tiles scaled so their largest magnitude maps to
e4m3's 448 under a power-of-two scale (the same scale, from the same bits, in both):

- ``write(flat, values, slots)``: DeepSeek-V3.2's 656-byte layout (stages/kernels/fp8_latent.py),
  the 512 no-rope values in 4 tiles of 128, the float32 scales and the 64 bf16 rope values;
  matches ``flat.index_copy_(0, slots, fp8_latent.quantize(values))``.
- ``write_v4(pages, values, slots)``: DeepSeek-V4's 584-byte layout
  (stages/kernels/fp8_v4_layout.py), 448 no-rope values in 7 tiles of 64 and the rope values in
  the block's value rows, the e8m0 scales after them; matches ``fp8_v4.write_reference``. Its
  ``rows``: up to two more per-token rows (the compressors' inputs) copied into their
  components at the same slots by the same launch, as ``dst.index_copy_(0, slots, src)``.
- ``write_indexer_key(pages, keys, slots)``: the FP8 indexer key (stages/kernels/fp8_indexer.py,
  V3.2's and V4's), the key as one tile in its block's value rows, its float32 scale after them;
  matches ``fp8_indexer.write_reference``.

Anything not on CUDA takes the torch path; so does a CUDA cache without triton, counted and
logged once (stages/kernels/fallbacks.py).
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_indexer, fp8_indexer_layout, fp8_latent, fp8_v4, fp8_v4_layout, pdl
from stages.kernels.fallbacks import record_fallback


def _torch_path(op: str, cache: torch.Tensor, rows: int) -> bool:
    """Whether this write takes the torch path: off CUDA (the one path there), with no rows,
    or on CUDA without triton (a fallback: counted, the first logged)."""
    if triton is None and cache.is_cuda and rows:
        record_fallback(op, "triton", "no_triton", "quantize-on-write in torch")
    return triton is None or not cache.is_cuda or rows == 0


def write(flat: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """flat [slots, 656] uint8 pages, values [T, 576] (any float), slots [T] long."""
    if _torch_path("fp8_latent_write", flat, values.shape[0]):
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
        **pdl.options(flat),
    )


def write_indexer_key(pages: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
    """pages [blocks, E, D + 4] (or [blocks, E, 1, D + 4]) uint8 in fp8_indexer's block layout,
    keys [T, D] (any float), slots [T] long."""
    if _torch_path("fp8_indexer_key_write", pages, keys.shape[0]):
        fp8_indexer.write_reference(pages, keys, slots)
        return
    dim = keys.shape[-1]
    if pages.shape[-1] != dim + fp8_indexer_layout.SCALE_BYTES:
        raise ValueError(f"FP8 indexer key pages of {pages.shape[-1]} bytes for keys of {dim}")
    values, scales = fp8_indexer.split(pages)
    k = keys.contiguous()
    _quantize_write_key[(k.shape[0],)](
        k,
        slots.contiguous(),
        values,
        scales,
        k.stride(0),
        values.stride(0),
        scales.stride(0),
        pages.shape[1],
        DIM=dim,
        BLOCK=triton.next_power_of_2(dim),
        FP8_MAX=fp8_latent.FP8_MAX,
        num_warps=1,
        **pdl.options(pages),
    )


MAX_ROWS = 2  # rows write_v4 copies beside the entry (a CSA layer's comp_in and index_in)


def write_v4(
    pages: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    rows: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (),
) -> None:
    """pages [blocks, P, 1, 584] (fp8_v4.allocate), values [T, 512] (any float), slots [T]; rows:
    (dst [S, W], src [T, W]) pairs, dst contiguous, src of dst's dtype, each src row written
    to dst[slot] in the same launch."""
    if len(rows) > MAX_ROWS or any(
        d.dim() != 2 or d.dtype != s.dtype or d.shape[1:] != s.shape[1:] or not d.is_contiguous()
        or s.shape[0] != values.shape[0]
        for d, s in rows
    ):  # fmt: skip
        raise ValueError(
            f"write_v4 copies up to {MAX_ROWS} [T, W] rows into contiguous [S, W] of their dtype"
        )
    if _torch_path("fp8_v4_write", pages, values.shape[0]):
        fp8_v4.write_reference(pages, values, slots)
        for dst, src in rows:
            dst.index_copy_(0, slots, src)
        return
    if values.shape[-1] != fp8_v4_layout.HEAD_DIM:
        raise ValueError(
            f"the V4 FP8 layout holds {fp8_v4_layout.HEAD_DIM} values per entry, "
            f"got {values.shape[-1]}"
        )
    v = values if values.stride(-1) == 1 else values.contiguous()  # rows may be strided
    srcs = [s if s.stride(-1) == 1 else s.contiguous() for _, s in rows]
    copies = [(d, s, s.stride(0), d.shape[1]) for (d, _), s in zip(rows, srcs)]
    copies += [(v, v, 0, 0)] * (MAX_ROWS - len(copies))  # unused: never touched
    _quantize_write_v4[(v.shape[0],)](
        v,
        slots.contiguous(),
        pages,
        pages.view(torch.uint8),
        pages.view(torch.bfloat16),
        v.stride(0),
        pages.stride(0),
        pages.shape[1],
        *(arg for copy in copies for arg in copy),
        NOPE=fp8_v4_layout.NOPE,
        ROPE=fp8_v4_layout.ROPE,
        TILE=fp8_v4_layout.TILE,
        FP8_MAX=fp8_latent.FP8_MAX,
        COPIES=len(rows),
        BLOCK_0=triton.next_power_of_2(max(copies[0][3], 1)),
        BLOCK_1=triton.next_power_of_2(max(copies[1][3], 1)),
        num_warps=4,
        **pdl.options(pages),
    )


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter

    @triton.jit  # type: ignore[untyped-decorator]
    def _pow2_scale(x, FP8_MAX: tl.constexpr, AXIS: tl.constexpr = 0):  # type: ignore[no-untyped-def]
        """(scale, its float32 exponent field): the least power of two >= max(|x|) / FP8_MAX
        (floored at 1e-4 / FP8_MAX) along AXIS, from its bits (exact, as
        fp8_latent.pow2_scale)."""
        amax = tl.maximum(tl.max(tl.abs(x), axis=AXIS), 1e-4) / FP8_MAX
        bits = amax.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        return (exponent << 23).to(tl.float32, bitcast=True), exponent

    @triton.jit  # type: ignore[untyped-decorator]
    def _quantize_write(  # type: ignore[no-untyped-def]
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
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        tiles: tl.constexpr = NOPE // TILE
        row_bytes: tl.constexpr = NOPE + 4 * tiles + 2 * ROPE
        offs = tl.arange(0, TILE)
        for i in tl.static_range(tiles):
            x = tl.load(v_ptr + t * stride_v + i * TILE + offs).to(tl.float32)
            scale, _exponent = _pow2_scale(x, FP8_MAX)
            tl.store(q_ptr + slot * row_bytes + i * TILE + offs, (x / scale).to(tl.float8e4nv))
            tl.store(scale_ptr + slot * (row_bytes // 4) + NOPE // 4 + i, scale)
        r = tl.arange(0, ROPE)
        rope = tl.load(v_ptr + t * stride_v + NOPE + r).to(tl.bfloat16)
        tl.store(rope_ptr + slot * (row_bytes // 2) + (NOPE + 4 * tiles) // 2 + r, rope)

    @triton.jit  # type: ignore[untyped-decorator]
    def _quantize_write_key(  # type: ignore[no-untyped-def]
        k_ptr,
        slot_ptr,
        values_ptr,
        scales_ptr,
        stride_k,
        stride_vb,
        stride_sb,
        entries,
        DIM: tl.constexpr,
        BLOCK: tl.constexpr,
        FP8_MAX: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        block, entry = slot // entries, slot % entries
        offs = tl.arange(0, BLOCK)
        mask = offs < DIM
        x = tl.load(k_ptr + t * stride_k + offs, mask=mask, other=0.0).to(tl.float32)
        scale, _exponent = _pow2_scale(x, FP8_MAX)
        row = values_ptr + block * stride_vb + entry * DIM
        tl.store(row + offs, (x / scale).to(tl.float8e4nv), mask=mask)
        tl.store(scales_ptr + block * stride_sb + entry, scale)

    @triton.jit  # type: ignore[untyped-decorator]
    def _quantize_write_v4(  # type: ignore[no-untyped-def]
        v_ptr,
        slot_ptr,
        q_ptr,
        byte_ptr,
        rope_ptr,
        stride_v,
        block_stride,
        entries,
        dst_0,
        src_0,
        stride_0,
        width_0,
        dst_1,
        src_1,
        stride_1,
        width_1,
        NOPE: tl.constexpr,
        ROPE: tl.constexpr,
        TILE: tl.constexpr,
        FP8_MAX: tl.constexpr,
        COPIES: tl.constexpr = 0,
        BLOCK_0: tl.constexpr = 1,
        BLOCK_1: tl.constexpr = 1,
        PDL: tl.constexpr = False,
    ):
        """COPIES: the token's rows of src_0 (and src_1) stored at its slot of dst_0 (dst_1)."""
        enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        block, offset = slot // entries, slot % entries
        value_bytes: tl.constexpr = NOPE + 2 * ROPE
        row = block * block_stride + offset * value_bytes  # the entry's value bytes
        # its scale bytes (the eighth, unused, stays as allocated: zero)
        scales = block * block_stride + entries * value_bytes + offset * 8
        offs = tl.arange(0, TILE)
        for i in tl.static_range(NOPE // TILE):
            x = tl.load(v_ptr + t * stride_v + i * TILE + offs).to(tl.float32)
            scale, exponent = _pow2_scale(x, FP8_MAX)
            tl.store(q_ptr + row + i * TILE + offs, (x / scale).to(tl.float8e4nv))
            tl.store(byte_ptr + scales + i, exponent.to(tl.uint8))
        r = tl.arange(0, ROPE)
        rope = tl.load(v_ptr + t * stride_v + NOPE + r).to(tl.bfloat16)
        tl.store(rope_ptr + (row + NOPE) // 2 + r, rope)
        if COPIES >= 1:
            c = tl.arange(0, BLOCK_0)
            x0 = tl.load(src_0 + t * stride_0 + c, mask=c < width_0)
            tl.store(dst_0 + slot * width_0 + c, x0, mask=c < width_0)
        if COPIES >= 2:
            c = tl.arange(0, BLOCK_1)
            x1 = tl.load(src_1 + t * stride_1 + c, mask=c < width_1)
            tl.store(dst_1 + slot * width_1 + c, x1, mask=c < width_1)

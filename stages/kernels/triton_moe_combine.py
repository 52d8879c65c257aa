"""The last step of the grouped MoE kernels (triton_moe, triton_moe_fp8, triton_moe_mxfp4): each
token's sum over its k picks of the down projection's rows, in fp32, cast once. One kernel reads
the [t * k, H] rows once; torch took three (the zero fill the rows' buffer needed for picks no
row writes, the fp32 sum over k, the cast). The rows come already times their routing weights,
or (`weights`) are multiplied by them here, in fp32 as torch_ref.per_expert does; `rows` reads
each pick's row where a GEMM left it in the routing layout (row_of_pair) instead of at its pair.

A pick with id -1 (another rank's expert, or none) has no row: its slot is never written and is
skipped here, so the buffer needs no zeros. The picks are added in order 0..k-1 in fp32; bf16
rows differ from torch's order only where their sum is inexact in fp32 (rare: k terms of 8
significant bits).
"""

from __future__ import annotations

import torch

from stages.kernels import pdl

# tokens x channels of a program (a 4096-wide hidden row: 8 programs across it)
BLOCK_T, BLOCK_H = 4, 512


def combine(
    y: torch.Tensor,
    topk_ids: torch.Tensor,
    dtype: torch.dtype,
    weights: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [t * k, H] (pair t * k + j: token t's pick j), topk_ids [t, k] (-1: no row) ->
    [t, H] in dtype: the valid picks' rows summed in fp32, each first times its weight
    (weights [t, k]) if given; rows [t * k] int32: pick t * k + j's row of y (else the pair)."""
    t, k = topk_ids.shape
    hidden = y.shape[1]
    out = torch.empty(t, hidden, dtype=dtype, device=y.device)
    if t == 0:
        return out
    if y.stride(-1) != 1 or topk_ids.stride(-1) != 1:
        raise ValueError("combine needs rows and ids with unit stride along their last dim")
    if weights is not None:
        weights = weights.reshape(t, k).contiguous()
    grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(hidden, BLOCK_H))
    _combine[grid](
        y, topk_ids, out, y if weights is None else weights, y if rows is None else rows,
        t, hidden, y.stride(0), topk_ids.stride(0), out.stride(0), K=k,
        WEIGHTED=weights is not None, BY_ROW=rows is not None, BLOCK_T=BLOCK_T,
        BLOCK_H=BLOCK_H, num_warps=4, **pdl.options(y),
    )  # fmt: skip
    return out


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter

    # fmt: off

    @triton.jit  # type: ignore[untyped-decorator]
    def _combine(  # type: ignore[no-untyped-def]
        y_ptr, ids_ptr, out_ptr, w_ptr, row_ptr, T, H, stride_y, stride_ids, stride_out,
        K: tl.constexpr, WEIGHTED: tl.constexpr, BY_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
    ):
        enter(PDL)
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_t, in_h = rows < T, (cols < H)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            picked = tl.load(ids_ptr + rows * stride_ids + j, mask=in_t, other=-1) >= 0
            pair = rows * K + j
            src = pair
            if BY_ROW:
                src = tl.load(row_ptr + pair, mask=picked, other=0).to(tl.int64)
            v = tl.load(y_ptr + src[:, None] * stride_y + cols[None, :],
                        mask=picked[:, None] & in_h, other=0.0).to(tl.float32)
            if WEIGHTED:
                v = v * tl.load(w_ptr + pair, mask=picked, other=0.0).to(tl.float32)[:, None]
            acc += v
        out = out_ptr + rows[:, None] * stride_out + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_t[:, None] & in_h)
    # fmt: on

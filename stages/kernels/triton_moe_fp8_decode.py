"""The FP8 routed experts of a decode step's few tokens with the experts' weight rows as the
MMA's wide side ("swap AB", as stages/kernels/triton_fp8_decode_linear.py does for the linears):
triton_moe_fp8's contract and, per row, the same arithmetic.

At one token a layer's 7 picks are 7 one-row tiles of triton_moe_fp8's 64-row layout: each K
step of its programs multiplies and promotes a [64, 256] (gate/up) or [64, 128] (down) block
for one real row, and the kernels stream the experts' weights at 2.6 and 2.9 TB/s on the H200
(session 29). Here the layout's tiles are DECODE_BLOCK_M rows (the MMA's narrow side); a
gate/up program takes one 128-wide group of gate and of up columns (256 weight rows) of a tile,
a down program BLOCK_W of the expert's output rows, so each K step promotes a [256 or BLOCK_W,
16] block. The products are the grouped GEMMs' (each 128-wide K step's fp32 product on the
tensor cores times the activation's and the weight's scales, summed in K order), the gate/up
epilogue the same (rounded to the activations' dtype, swiglu_steps, the 1 x 128 quantizer), the
down rows stored at their (token, k) slots (64-wide gate/up groups, twice the programs, with the
down kernel quantizing the SwiGLU as it read it were slower: a tile quantized inside the K loop
goes through shared memory before its MMA, docs/PERFORMANCE.md). The grids are fixed by the
layout's tile bound (a CUDA graph captures them); a program past the tiles in use returns.
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_ref, pdl, triton_fp8_act
from stages.kernels.moe_routing import Routing

BLOCK = fp8_ref.BLOCK
DECODE_BLOCK_M = 16  # the layout's rows a tile: the MMA's narrow side
BLOCK_W = 64  # a down program's weight rows
GATE_UP_LAUNCH = (4, 4)  # (warps, stages): 32 KB of gate and up weights a stage
DOWN_LAUNCH = (4, 6)  # 8 KB of weights a stage


def moe(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    w_down: torch.Tensor,
    d_scale: torch.Tensor,
    r: Routing,
    dtype: torch.dtype,
    limit: float | None,
    pairs: int,
) -> torch.Tensor:
    """The routed rows' expert outputs y [pairs, H] (each at its pair's slot) from the layout's
    FP8 rows."""
    hq, hs = gate_up_swiglu(a, a_scale, gate_up, gu_scale, r, dtype, limit)
    return down(hq, hs, w_down, d_scale, r, dtype, pairs)


def gate_up_swiglu(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    r: Routing,
    dtype: torch.dtype,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_moe_fp8.gate_up_swiglu's contract over a layout of DECODE_BLOCK_M-row tiles."""
    rows, k = q.shape
    inter = gate_up.shape[1] // 2
    if inter % BLOCK or r.block_m != DECODE_BLOCK_M:
        raise ValueError(f"takes I on the 128 grid and {DECODE_BLOCK_M}-row tiles")
    hq = torch.empty(rows, inter, dtype=fp8_ref.FP8, device=q.device)
    hs = torch.empty(rows, inter // BLOCK, dtype=torch.float32, device=q.device)
    ws = gu_scale.float().contiguous()
    warps, stages = GATE_UP_LAUNCH
    _swapped_gate_up[(r.max_tiles, inter // BLOCK)](
        q, q_scale, gate_up, ws, hq, hs, r.tile_expert, r.num_tiles, r.pair_of_row, inter, k,
        q.stride(0), q_scale.stride(0), gate_up.stride(0), gate_up.stride(1), ws.stride(0),
        ws.stride(1), hq.stride(0), hs.stride(0),
        0.0 if limit is None else triton_fp8_act.rounded(limit, dtype),
        HAS_LIMIT=limit is not None, CUDA_EXP=q.is_cuda, H_DTYPE=_TL_DTYPES[dtype],
        INV_FP8_MAX=1 / fp8_ref.FP8_MAX, MIN_SCALE=fp8_ref.MIN_SCALE, BLOCK_X=r.block_m,
        BLOCK_N=BLOCK, BLOCK_K=BLOCK, STAGES=stages, num_warps=warps, **pdl.options(hq),
    )  # fmt: skip
    return hq, hs


def down(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    r: Routing,
    dtype: torch.dtype,
    pairs: int,
) -> torch.Tensor:
    """triton_moe_fp8.grouped_gemm(..., pairs=pairs)'s contract (each real row at its pair's
    slot) over a layout of DECODE_BLOCK_M-row tiles."""
    k = q.shape[1]
    n = w.shape[1]
    if k % BLOCK or r.block_m != DECODE_BLOCK_M:
        raise ValueError(f"takes K on the 128 grid and {DECODE_BLOCK_M}-row tiles")
    c = torch.empty(pairs, n, dtype=dtype, device=q.device)
    ws = w_scale.float().contiguous()
    warps, stages = DOWN_LAUNCH
    _swapped_down[(r.max_tiles, triton.cdiv(n, BLOCK_W))](
        q, q_scale, w, ws, c, r.tile_expert, r.num_tiles, r.pair_of_row, n, k, q.stride(0),
        q_scale.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), c.stride(0),
        BLOCK_X=r.block_m, BLOCK_W=BLOCK_W, BLOCK_K=BLOCK, STAGES=stages, num_warps=warps,
        **pdl.options(c),
    )  # fmt: skip
    return c


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter
    from stages.kernels.triton_fp8_act import _quantize_store, swiglu_steps

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _swapped_gate_up(  # type: ignore[no-untyped-def]
        a_ptr, as_ptr, w_ptr, ws_ptr, q_ptr, qs_ptr, tile_expert_ptr, num_tiles_ptr, pair_ptr,
        INTER, K, stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
        stride_qm, stride_qsm, limit, HAS_LIMIT: tl.constexpr, CUDA_EXP: tl.constexpr,
        H_DTYPE: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
        BLOCK_X: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """Tile program_id(0)'s rows at gate columns n * 128 + [0, 128) and the same up
        columns (program_id(1) = n), their weight rows interleaved g0 u0 g1 u1 ... as
        triton_moe_fp8._gate_up_side_by_side's, each K step's product scaled per weight row."""
        enter(PDL)
        tile = tl.program_id(0)
        if tile >= tl.load(num_tiles_ptr):
            return
        n = tl.program_id(1)
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        rows = (tile * BLOCK_X + tl.arange(0, BLOCK_X)).to(tl.int64)
        cols = (n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        both = tl.reshape(tl.join(cols, INTER + cols), (2 * BLOCK_N,))
        is_gate = (tl.arange(0, 2 * BLOCK_N) % 2) == 0
        w_rows = w_ptr + expert * stride_we + both[:, None] * stride_wn
        gate_scales = ws_ptr + expert * stride_wse + n * stride_wsn
        up_scales = gate_scales + (INTER // BLOCK_N) * stride_wsn
        a_rows = a_ptr + rows[:, None] * stride_am
        a_scales = as_ptr + rows * stride_as
        acc = tl.zeros((2 * BLOCK_N, BLOCK_X), dtype=tl.float32)
        for ki in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + ks[None, :])
            a = tl.load(a_rows + ks[None, :])
            a_s = tl.load(a_scales + ki)
            w_s = tl.where(is_gate, tl.load(gate_scales + ki), tl.load(up_scales + ki))
            acc += tl.dot(w, tl.trans(a)) * (a_s[None, :] * w_s[:, None])
        # [2 BLOCK_N, BLOCK_X] -> gate, up [BLOCK_X, BLOCK_N]
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N, 2, BLOCK_X)), (2, 0, 1)))
        h = swiglu_steps(gate.to(H_DTYPE), up.to(H_DTYPE), limit, HAS_LIMIT, CUDA_EXP)
        real = tl.load(pair_ptr + rows) >= 0
        _quantize_store(h, rows, cols, n, real, real, q_ptr, qs_ptr, INTER, stride_qm,
                        stride_qsm, 1, INV_FP8_MAX, MIN_SCALE)

    @triton.jit  # type: ignore[untyped-decorator]
    def _swapped_down(  # type: ignore[no-untyped-def]
        a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, tile_expert_ptr, num_tiles_ptr, pair_ptr, N, K,
        stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
        BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """Tile program_id(0)'s rows at output columns program_id(1) * BLOCK_W + [0, BLOCK_W),
        each real row stored at its pair's slot."""
        enter(PDL)
        tile = tl.program_id(0)
        if tile >= tl.load(num_tiles_ptr):
            return
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        col_ok = cols < N
        w_cols = tl.where(col_ok, cols, 0).to(tl.int64)
        w_rows = w_ptr + expert * stride_we + w_cols[:, None] * stride_wn
        # BLOCK_W divides the scale block: one weight scale a K step for the whole tile
        block_row = tl.program_id(1) * BLOCK_W // BLOCK_K
        w_scales = ws_ptr + expert * stride_wse + block_row * stride_wsn
        rows = (tile * BLOCK_X + tl.arange(0, BLOCK_X)).to(tl.int64)
        a_rows = a_ptr + rows[:, None] * stride_am
        a_scales = as_ptr + rows * stride_as
        acc = tl.zeros((BLOCK_W, BLOCK_X), dtype=tl.float32)
        for ki in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + ks[None, :])
            a = tl.load(a_rows + ks[None, :])
            a_s = tl.load(a_scales + ki)
            acc += tl.dot(w, tl.trans(a)) * (a_s[None, :] * tl.load(w_scales + ki))
        pair = tl.load(pair_ptr + rows)
        keep = (pair[None, :] >= 0) & col_ok[:, None]
        c_ptrs = c_ptr + pair.to(tl.int64)[None, :] * stride_cm + cols[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=keep)
    # fmt: on

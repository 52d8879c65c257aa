"""Routed experts with FP8 weights on one grouped persistent Triton GEMM per projection: the
contract of fp8_ref.moe_experts (W8A8: each GEMM's input quantized in 1 x 128 groups, the
experts' weights e4m3 with 128 x 128 scales). Rows are sorted by expert on the device and
walked with a tile map of expert segments (grid = SMs, or SMs - 1 leaving an SM to a
waiting NCCL recv); each 128-wide K tile is one activation group and one weight block.

Anything not on CUDA goes to fp8_ref.moe_experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stages.kernels import fp8_ref
from stages.kernels.triton_gemm import num_sms

BLOCK_M, BLOCK = 64, fp8_ref.BLOCK


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None and torch.cuda.get_device_capability()[0] >= 9


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, gu_scale: torch.Tensor,
                down: torch.Tensor, d_scale: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, fp8_linear: Any = None) -> torch.Tensor:
    return _moe(x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, sm_margin=0)


def moe_experts_sm1(x: torch.Tensor, gate_up: torch.Tensor, gu_scale: torch.Tensor,
                    down: torch.Tensor, d_scale: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, fp8_linear: Any = None) -> torch.Tensor:
    return _moe(x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, sm_margin=1)


@dataclass
class TileMap:
    """Device-side map of a grouped GEMM's M tiles to expert segments."""
    tile_expert: torch.Tensor  # [max_tiles] int32, -1 past the last real tile
    tile_row: torch.Tensor  # [max_tiles] int32: first row of the tile
    seg_end: torch.Tensor  # [E] int32: one past each expert's last row

    @classmethod
    def build(cls, expert_of_row_sorted_counts: torch.Tensor, num_rows: int,
              block_m: int) -> "TileMap":
        counts = expert_of_row_sorted_counts
        e = counts.numel()
        tiles = (counts + block_m - 1) // block_m
        cum = tiles.cumsum(0)
        first_tile = cum - tiles
        seg_start = counts.cumsum(0) - counts
        max_tiles = -(-num_rows // block_m) + e  # each segment adds at most one partial tile
        idx = torch.arange(max_tiles, device=counts.device)
        expert = torch.searchsorted(cum, idx, right=True)
        valid = expert < e
        ec = expert.clamp(max=e - 1)
        row = seg_start[ec] + (idx - first_tile[ec]) * block_m
        return cls(torch.where(valid, expert, -1).to(torch.int32), row.to(torch.int32),
                   (seg_start + counts).to(torch.int32))


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    tiles: TileMap,
    grid: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """c[r] = W8A8(a[r], w[expert(r)]) for rows sorted by expert: a [R, K], w [E, N, K] fp8."""
    q, s = fp8_ref.quantize_act(a)
    rows, k = q.shape
    n = w.shape[1]
    c = torch.empty(rows, n, dtype=dtype, device=a.device)
    ws = w_scale.float().contiguous()
    max_tiles = tiles.tile_expert.numel()
    progs = max(1, min(grid, max_tiles * triton.cdiv(n, BLOCK)))
    args: list[Any] = [
        q,
        s,
        w,
        ws,
        c,
        tiles.tile_expert,
        tiles.tile_row,
        tiles.seg_end,
        max_tiles,
        n,
        k,
        progs,
        q.stride(0),
        s.stride(0),
        w.stride(0),
        w.stride(1),
        ws.stride(0),
        ws.stride(1),
        c.stride(0),
    ]
    _grouped_w8a8[(progs,)](
        *args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK, BLOCK_K=BLOCK, num_warps=4, num_stages=3
    )
    return c


def _moe(x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, sm_margin: int):
    if triton is None or not x.is_cuda:
        return fp8_ref.moe_experts(x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights)
    t, k = topk_ids.shape
    e = gate_up.shape[0]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(e, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    tiles = TileMap.build(counts, t * k, BLOCK_M)
    grid = num_sms(x.device) - sm_margin
    a = x.index_select(0, order // k)
    gate, up = grouped_gemm(a, gate_up, gu_scale, tiles, grid, x.dtype).chunk(2, dim=-1)
    y = grouped_gemm(F.silu(gate) * up, down, d_scale, tiles, grid, x.dtype)
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    out = (unsorted.view(t, k, -1).float() * topk_weights[:, :, None].float()).sum(dim=1)
    return out.to(x.dtype)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit
    def _grouped_w8a8(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        tile_expert_ptr,
        tile_row_ptr,
        seg_end_ptr,
        num_m_tiles,
        N,
        K,
        num_progs,
        stride_am,
        stride_as,
        stride_we,
        stride_wn,
        stride_wse,
        stride_wsn,
        stride_cm,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        start = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_tiles = num_m_tiles * num_pid_n
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile_id in tl.range(start, num_tiles, num_progs):
            m_tile = tile_id // num_pid_n
            pid_n = tile_id % num_pid_n
            expert = tl.load(tile_expert_ptr + m_tile)
            if expert >= 0:
                row0 = tl.load(tile_row_ptr + m_tile)
                end = tl.load(seg_end_ptr + expert)
                rows = row0 + tl.arange(0, BLOCK_M)
                cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                rows_safe = tl.where(rows < end, rows, row0).to(tl.int64)
                cols_safe = tl.where(cols < N, cols, 0).to(tl.int64)
                w_base = w_ptr + expert.to(tl.int64) * stride_we
                ws_base = ws_ptr + expert.to(tl.int64) * stride_wse + pid_n * stride_wsn
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ki in range(k_tiles):
                    ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
                    kmask = ks[None, :] < K
                    a = tl.load(
                        a_ptr + rows_safe[:, None] * stride_am + ks[None, :], mask=kmask, other=0.0
                    )
                    w = tl.load(
                        w_base + cols_safe[:, None] * stride_wn + ks[None, :], mask=kmask, other=0.0
                    )
                    a_s = tl.load(as_ptr + rows_safe * stride_as + ki)
                    w_s = tl.load(ws_base + ki)
                    acc += tl.dot(a, w.T) * (a_s[:, None] * w_s)
                mask = (rows[:, None] < end) & (cols[None, :] < N)
                c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
                tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

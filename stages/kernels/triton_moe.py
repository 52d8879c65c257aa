"""Routed MoE experts on a grouped persistent Triton GEMM (DESIGN §1, §7).

``moe_experts(x, gate_up, down, topk_ids, topk_weights)`` matches
``stages.kernels.torch_ref.moe_experts``. The (token, expert) pairs are sorted by expert on the
device (no host sync: the tile map is sized by an upper bound), each expert's rows form a
segment, and one kernel launch per projection walks every (segment tile, N tile) with a grid of
one program per SM (``moe_experts_sm1``: SMs - 1, leaving an SM to a waiting NCCL recv). The
grid and tile walk are those of ``stages.kernels.triton_gemm``; loads are masked pointer loads
since segments start at any row.

Anything that is not a bf16 CUDA tensor goes to the torch reference. Imports cleanly without
triton or CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.kernels import torch_ref
from stages.kernels.triton_gemm import num_sms


@dataclass(frozen=True)
class MoeGemmConfig:
    block_m: int = 64  # segments are short (tokens x k / experts rows): small M tiles
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 3
    num_warps: int = 4


DEFAULT = MoeGemmConfig()


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None


def moe_experts(x, gate_up, down, topk_ids, topk_weights, limit=None) -> torch.Tensor:
    return _moe(x, gate_up, down, topk_ids, topk_weights, limit, sm_margin=0)


def moe_experts_sm1(x, gate_up, down, topk_ids, topk_weights, limit=None) -> torch.Tensor:
    return _moe(x, gate_up, down, topk_ids, topk_weights, limit, sm_margin=1)


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


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, tiles: TileMap, grid: int,
                 cfg: MoeGemmConfig = DEFAULT) -> torch.Tensor:
    """c[r] = a[r] @ w[expert(r)].T for rows sorted by expert: a [R, K], w [E, N, K]."""
    rows, k = a.shape
    n = w.shape[1]
    c = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    max_tiles = tiles.tile_expert.numel()
    total = max_tiles * triton.cdiv(n, cfg.block_n)
    progs = max(1, min(grid, total))
    _grouped_gemm[(progs,)](a, w, c, tiles.tile_expert, tiles.tile_row, tiles.seg_end,
                            max_tiles, n, k, progs, a.stride(0), w.stride(0), w.stride(1),
                            c.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                            BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                            num_stages=cfg.num_stages)
    return c


def _moe(x, gate_up, down, topk_ids, topk_weights, limit, sm_margin: int) -> torch.Tensor:
    usable = (triton is not None and x.is_cuda and x.dtype == torch.bfloat16
              and gate_up.dtype == torch.bfloat16 and down.dtype == torch.bfloat16)
    if not usable:
        return torch_ref.moe_experts(x, gate_up, down, topk_ids, topk_weights, limit)
    t, k = topk_ids.shape
    e = gate_up.shape[0]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    # counts without bincount, whose output size makes the host wait for the device
    counts = torch.zeros(e, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    tiles = TileMap.build(counts, t * k, DEFAULT.block_m)
    grid = num_sms(x.device) - sm_margin
    a = x.index_select(0, order // k).contiguous()
    gate, up = grouped_gemm(a, gate_up.contiguous(), tiles, grid).chunk(2, dim=-1)
    y = grouped_gemm(torch_ref.swiglu(gate, up, limit).contiguous(), down.contiguous(), tiles,
                     grid)
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
    def _grouped_gemm(a_ptr, w_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, seg_end_ptr,
                      num_m_tiles, N, K, num_progs, stride_am, stride_we, stride_wn, stride_cm,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ki in range(k_tiles):
                    ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
                    kmask = ks[None, :] < K
                    a = tl.load(a_ptr + rows_safe[:, None] * stride_am + ks[None, :],
                                mask=kmask, other=0.0)
                    w = tl.load(w_base + cols_safe[:, None] * stride_wn + ks[None, :],
                                mask=kmask, other=0.0)
                    acc = tl.dot(a, w.T, acc)
                mask = (rows[:, None] < end) & (cols[None, :] < N)
                c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
                tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

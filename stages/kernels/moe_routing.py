"""The grouped contiguous layout of a MoE batch (DeepGEMM's), built on the device with no host
sync: the (token, expert) pairs sorted by expert, each expert's rows padded to a multiple of
BLOCK_M, so every M tile of the grouped GEMMs belongs to one expert.

``route`` builds it with torch ops (the reference the CPU tests read); ``route_and_gather``
builds the same layout with three small Triton kernels and copies each pair's token row into
it on the way (``route_and_gather_scaled``: an FP8 row's scales too). Within an expert the
rows' order follows atomic counters, so it may differ from ``route``'s: each row of a GEMM is
computed on its own, so the results do not depend on it. A pick of id -1 (an expert another
rank holds, under expert parallelism) gets no row and its output slot is never written.
Buffers are sized by the layout's upper bound; the number of real tiles stays on the device.
A batch of up to ONE_PROGRAM_PAIRS pairs (decode) is counted and planned by one program (a
histogram in registers), two launches fewer than the counters' fill, the atomic count and the
plan that longer ones take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.kernels import pdl

# pairs (tokens x k) counted and planned in one program: a 512-row decode step's 512 x 7
ONE_PROGRAM_PAIRS = 4096


@dataclass
class Routing:
    pair_of_row: torch.Tensor  # [rows] int32: flat index t * k + j of the pair; -1 on padding
    row_weight: torch.Tensor  # [rows] fp32: the pair's routing weight (undefined on padding)
    tile_expert: torch.Tensor  # [max_tiles] int32: the expert of each M tile
    num_tiles: torch.Tensor  # [1] int32: M tiles in use (the rest of the buffers is unused)
    block_m: int
    # [pairs] int32: the row of each pair (undefined for a pick of id -1): where a combine reads
    # a GEMM's rows in the layout's order (DeepGEMM's, which writes no pair slots)
    row_of_pair: torch.Tensor
    # [rows] int32, if asked for: each row's expert, -1 on padding (DeepGEMM's m_indices)
    expert_of_row: torch.Tensor | None = None

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.numel()


def max_tiles(pairs: int, experts: int, block_m: int) -> int:
    """Every expert with pairs adds at most one partial tile to the unpadded count."""
    return -(-pairs // block_m) + min(experts, pairs)


def route(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, block_m: int
) -> Routing:
    """The layout with torch ops (pairs of an expert in their flat order; padding weighs 0).
    A pick of id -1 (no expert here) gets no row."""
    flat = topk_ids.reshape(-1).long()
    n, device = flat.numel(), flat.device
    key = torch.where(flat >= 0, flat, num_experts)  # skipped picks: one bucket past the last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, key, torch.ones_like(key)
    )[:num_experts]
    tiles = (counts + block_m - 1) // block_m
    cum_tiles = tiles.cumsum(0)
    bound = max_tiles(n, num_experts, block_m)
    order = key.argsort(stable=True)  # skipped picks last
    expert_sorted = key[order].clamp(max=num_experts - 1)
    seg_start = counts.cumsum(0) - counts
    rank = torch.arange(n, device=device) - seg_start[expert_sorted]
    dest = (cum_tiles - tiles)[expert_sorted] * block_m + rank
    trash = bound * block_m  # where skipped picks land, cut off below (no host sync)
    dest = torch.where(key[order] < num_experts, dest, trash)
    pair_of_row = torch.full((trash + 1,), -1, dtype=torch.int32, device=device)
    pair_of_row[dest] = order.int()
    row_weight = torch.zeros(trash + 1, dtype=torch.float32, device=device)
    row_weight[dest] = topk_weights.reshape(-1).float()[order]
    pair_of_row, row_weight = pair_of_row[:trash], row_weight[:trash]
    row_of_pair = torch.full((n,), -1, dtype=torch.int32, device=device)
    row_of_pair[order] = torch.where(dest < trash, dest, -1).int()
    tile_idx = torch.arange(bound, device=device)
    tile_expert = torch.searchsorted(cum_tiles, tile_idx, right=True).clamp_(max=num_experts - 1)
    tiles_used = cum_tiles[-1:].int()
    return Routing(pair_of_row, row_weight, tile_expert.int(), tiles_used, block_m, row_of_pair)


def contiguous_layout(
    pair_of_row: torch.Tensor, tile_expert: torch.Tensor, block_m: int
) -> torch.Tensor:
    """Each row's expert, -1 on padding rows and the unused tail (int32 [rows]), from a layout's
    pairs and tiles with torch ops: what route_and_gather_scaled(deepgemm=True) writes as
    Routing.expert_of_row, DeepGEMM's grouped_layout (m_indices) for a layout built with
    block_m = its M alignment (DeepGEMM reads a block's expert from its first row and skips a
    block or half block whose first row is -1)."""
    tile = torch.arange(pair_of_row.numel(), device=pair_of_row.device) // block_m
    expert = tile_expert.long().index_select(0, tile)
    return torch.where(pair_of_row >= 0, expert, -1).int()


def route_and_gather(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> tuple[Routing, torch.Tensor]:
    """(the layout, x's rows in it [rows, H]; padding rows are left unwritten)."""
    r, a, _ = _route_gather(x, None, topk_ids, topk_weights, num_experts, block_m)
    return r, a


def route_and_gather_scaled(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    block_m: int,
    deepgemm: bool = False,
) -> tuple[Routing, torch.Tensor, torch.Tensor]:
    """route_and_gather of quantized rows x with their scales x_scale [T, S] fp32 gathered
    beside them by the same kernel: (the layout, rows [rows, H], scales [rows, S]; padding rows
    of both unwritten). deepgemm: DeepGEMM's SM90 operands, the scales a view of a contiguous
    [S, rows] tensor (MN-major) and each row's expert (Routing.expert_of_row, its m_indices)."""
    r, a, scale = _route_gather(x, x_scale, topk_ids, topk_weights, num_experts, block_m, deepgemm)
    assert scale is not None
    return r, a, scale


def _route_gather(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    block_m: int,
    deepgemm: bool = False,
) -> tuple[Routing, torch.Tensor, torch.Tensor | None]:
    import triton

    t, k = topk_ids.shape
    n, hidden, device = t * k, x.shape[1], x.device
    bound = max_tiles(n, num_experts, block_m)
    ids = topk_ids.reshape(-1).contiguous()  # any integer dtype: the kernels read it as is
    tile_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    tile_expert = torch.empty(bound, dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    pair_of_row = torch.empty(bound * block_m, dtype=torch.int32, device=device)  # _plan: -1
    row_weight = torch.empty(bound * block_m, dtype=torch.float32, device=device)
    row_of_pair = torch.empty(n, dtype=torch.int32, device=device)
    # (without DeepGEMM's operands the kernels store none: pair_of_row stands in as the pointer)
    expert_of_row = torch.empty_like(pair_of_row) if deepgemm else pair_of_row
    a = torch.empty(bound * block_m, hidden, dtype=x.dtype, device=device)
    scales = x_scale.contiguous() if x_scale is not None else None
    a_scale = None
    if scales is not None:
        shape = (bound * block_m, scales.shape[1])
        if deepgemm:
            a_scale = torch.empty(shape[::-1], dtype=scales.dtype, device=device).t()
        else:
            a_scale = torch.empty(shape, dtype=scales.dtype, device=device)
    plan_outs = (
        tile_start, tile_expert, num_tiles, pair_of_row, expert_of_row, num_experts, bound, block_m
    )  # fmt: skip
    plan_blocks = dict(BLOCK_T=32, BLOCK_R=1024, EXPERT_ROWS=deepgemm)
    if n <= ONE_PROGRAM_PAIRS:  # a decode batch: count and plan in one program, no fill
        cursors = torch.empty(num_experts, dtype=torch.int32, device=device)
        _count_plan[(1,)](
            ids, cursors, n, *plan_outs, BLOCK_N=max(16, triton.next_power_of_2(n)),
            BLOCK_E=triton.next_power_of_2(num_experts + 1), **plan_blocks, **pdl.options(ids),
        )  # fmt: skip
    else:
        counters = torch.zeros(2, num_experts, dtype=torch.int32, device=device)
        block = 256
        _count[(triton.cdiv(n, block),)](ids, counters, n, BLOCK=block, **pdl.options(ids))
        _plan[(1,)](
            counters, *plan_outs, BLOCK_E=triton.next_power_of_2(num_experts), **plan_blocks,
            **pdl.options(ids),
        )  # fmt: skip
        cursors = counters[1]
    pairs = 16
    _scatter[(triton.cdiv(n, pairs),)](
        x.contiguous(),
        ids,
        topk_weights.reshape(-1).contiguous(),  # read as float32 by the kernel
        a,
        pair_of_row,
        row_weight,
        row_of_pair,
        expert_of_row,
        tile_start,
        cursors,
        a if scales is None else scales,
        a if a_scale is None else a_scale,
        n,
        hidden,
        k,
        block_m,
        0 if scales is None else scales.shape[1],
        0 if a_scale is None else a_scale.stride(0),
        0 if a_scale is None else a_scale.stride(1),
        BLOCK_P=pairs,
        BLOCK_H=256,
        SCALES=scales is not None,
        EXPERT_ROWS=deepgemm,
        BLOCK_S=triton.next_power_of_2(1 if scales is None else scales.shape[1]),
        **pdl.options(ids),
    )
    expert_rows = expert_of_row if deepgemm else None
    r = Routing(pair_of_row, row_weight, tile_expert, num_tiles, block_m, row_of_pair, expert_rows)
    return r, a, a_scale


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter

    @triton.jit  # type: ignore[untyped-decorator]
    def _count(  # type: ignore[no-untyped-def]
        ids_ptr, counts_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False
    ):
        enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        expert = tl.load(ids_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
        keep = expert >= 0  # -1: a pick no expert here runs
        tl.atomic_add(counts_ptr + expert, 1, mask=keep)

    @triton.jit  # type: ignore[untyped-decorator]
    def _plan(  # type: ignore[no-untyped-def]
        counters_ptr,
        tile_start_ptr,
        tile_expert_ptr,
        num_tiles_ptr,
        pair_ptr,
        expert_row_ptr,
        E,
        MAX_TILES,
        BLOCK_M,
        BLOCK_E: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        EXPERT_ROWS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        es = tl.arange(0, BLOCK_E)
        counts = tl.load(counters_ptr + es, mask=es < E, other=0)
        _plan_counts(
            counts,
            es,
            tile_start_ptr,
            tile_expert_ptr,
            num_tiles_ptr,
            pair_ptr,
            expert_row_ptr,
            E,
            MAX_TILES,
            BLOCK_M,
            BLOCK_T,
            BLOCK_R,
            EXPERT_ROWS,
        )

    @triton.jit  # type: ignore[untyped-decorator]
    def _count_plan(  # type: ignore[no-untyped-def]
        ids_ptr,
        cursors_ptr,
        N,
        tile_start_ptr,
        tile_expert_ptr,
        num_tiles_ptr,
        pair_ptr,
        expert_row_ptr,
        E,
        MAX_TILES,
        BLOCK_M,
        BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        EXPERT_ROWS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """_count and _plan of up to BLOCK_N pairs in one program: the counts a histogram (a
        skipped pick, id -1, in bin E, past the experts), _scatter's cursors zeroed."""
        enter(PDL)
        offs = tl.arange(0, BLOCK_N)
        expert = tl.load(ids_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
        counts = tl.histogram(tl.where(expert >= 0, expert, E), BLOCK_E, mask=offs < N)
        es = tl.arange(0, BLOCK_E)
        counts = tl.where(es < E, counts, 0)
        tl.store(cursors_ptr + es, tl.zeros((BLOCK_E,), tl.int32), mask=es < E)
        _plan_counts(
            counts,
            es,
            tile_start_ptr,
            tile_expert_ptr,
            num_tiles_ptr,
            pair_ptr,
            expert_row_ptr,
            E,
            MAX_TILES,
            BLOCK_M,
            BLOCK_T,
            BLOCK_R,
            EXPERT_ROWS,
        )

    @triton.jit  # type: ignore[untyped-decorator]
    def _plan_counts(  # type: ignore[no-untyped-def]
        counts,
        es,
        tile_start_ptr,
        tile_expert_ptr,
        num_tiles_ptr,
        pair_ptr,
        expert_row_ptr,
        E,
        MAX_TILES,
        BLOCK_M,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        EXPERT_ROWS: tl.constexpr,
    ):
        """The layout from each expert's pair count (counts [BLOCK_E], 0 past E)."""
        real = es < E
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        cum = tl.cumsum(tiles, 0)
        tl.store(tile_start_ptr + es, cum - tiles, mask=real)
        tl.store(num_tiles_ptr, tl.sum(tiles, 0))
        for m0 in range(0, MAX_TILES, BLOCK_T):
            ms = m0 + tl.arange(0, BLOCK_T)
            # the expert of tile m: how many experts' tiles all end at or before m
            before = (cum[None, :] <= ms[:, None]) & real[None, :]
            expert = tl.minimum(tl.sum(before.to(tl.int32), 1), E - 1)
            tl.store(tile_expert_ptr + ms, expert, mask=ms < MAX_TILES)
        for r0 in range(0, MAX_TILES * BLOCK_M, BLOCK_R):  # every row a padding row until
            rows = r0 + tl.arange(0, BLOCK_R)  # _scatter places the pairs
            none = tl.full((BLOCK_R,), -1, tl.int32)
            tl.store(pair_ptr + rows, none, mask=rows < MAX_TILES * BLOCK_M)
            if EXPERT_ROWS:
                tl.store(expert_row_ptr + rows, none, mask=rows < MAX_TILES * BLOCK_M)

    @triton.jit  # type: ignore[untyped-decorator]
    def _scatter(  # type: ignore[no-untyped-def]
        x_ptr,
        ids_ptr,
        w_ptr,
        a_ptr,
        pair_ptr,
        row_weight_ptr,
        row_of_pair_ptr,
        expert_row_ptr,
        tile_start_ptr,
        fill_ptr,
        scale_ptr,
        a_scale_ptr,
        N,
        H,
        TOPK,
        BLOCK_M,
        S,
        stride_asr,
        stride_ass,
        BLOCK_P: tl.constexpr,
        BLOCK_H: tl.constexpr,
        SCALES: tl.constexpr,
        BLOCK_S: tl.constexpr,
        EXPERT_ROWS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        expert = tl.load(ids_ptr + pairs, mask=pairs < N, other=-1).to(tl.int32)
        keep = expert >= 0
        rank = tl.atomic_add(fill_ptr + expert, 1, mask=keep)
        dest = tl.load(tile_start_ptr + expert, mask=keep, other=0) * BLOCK_M + rank
        tl.store(pair_ptr + dest, pairs, mask=keep)
        tl.store(row_of_pair_ptr + pairs, dest, mask=keep)
        if EXPERT_ROWS:
            tl.store(expert_row_ptr + dest, expert, mask=keep)
        weight = tl.load(w_ptr + pairs, mask=keep, other=0.0).to(tl.float32)
        tl.store(row_weight_ptr + dest, weight, mask=keep)
        token = (pairs // TOPK).to(tl.int64)
        dest = dest.to(tl.int64)
        for hi in range((H + BLOCK_H - 1) // BLOCK_H):
            cols = hi * BLOCK_H + tl.arange(0, BLOCK_H)
            both = keep[:, None] & (cols[None, :] < H)
            v = tl.load(x_ptr + token[:, None] * H + cols[None, :], mask=both)
            tl.store(a_ptr + dest[:, None] * H + cols[None, :], v, mask=both)
        if SCALES:  # the row's quantization scales beside it
            cols = tl.arange(0, BLOCK_S)
            both = keep[:, None] & (cols[None, :] < S)
            v = tl.load(scale_ptr + token[:, None] * S + cols[None, :], mask=both)
            out = a_scale_ptr + dest[:, None] * stride_asr + cols[None, :] * stride_ass
            tl.store(out, v, mask=both)

"""The `v4_window_index` / `v4_rate_index` / `v4_pick_slots` ops
(stages/kernels/v4_paged_index.py) in one Triton kernel each: a program per row reads its
position, length and block table row and writes every index tensor of the row (or its picks'
slots). The torch forms take about 15, 35 and 5 small kernels (each [B] or [B, k] wide), which in
a CUDA-graph decode step of V4's two rates came to ~100 launches of ~4 us, more than the step's
arithmetic. Integers only: the same values as the torch forms, bit for bit. Inputs off CUDA take
the torch forms, counted and logged once (stages/kernels/fallbacks.py)."""

from __future__ import annotations

import torch

from stages.kernels import pdl
from stages.kernels import v4_paged_index as reference
from stages.kernels.fallbacks import record_fallback
from stages.kernels.v4_paged_index import RateIndex, WindowIndex

# a row's entries a program writes per step (a 256K row has 64K at rate 4)
ENTRIES_A_STEP = 1024


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None


def _refused(op: str, positions: torch.Tensor) -> bool:
    reason = "no_triton" if triton is None else None if positions.is_cuda else "device"
    if reason is not None and positions.shape[0]:
        record_fallback(op, "triton", reason, f"{positions.device} -> torch")
    return reason is not None


def window_index(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int,
) -> WindowIndex:
    if _refused("v4_window_index", positions):
        return reference.window_index(
            positions, lengths, table_rows, block_tables, block_size, window
        )
    return launch_window(positions, lengths, table_rows, block_tables, block_size, window)


def rate_index(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int,
    rate: int,
    most: int,
    dense: bool,
    scratch_slot: int,
) -> RateIndex:
    args = (positions, lengths, table_rows, block_tables, block_size, window, rate, most, dense)
    if _refused("v4_rate_index", positions):
        return reference.rate_index(*args, scratch_slot)
    return launch_rate(*args, scratch_slot)


def pick_slots(
    picked: torch.Tensor, table: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _refused("v4_pick_slots", picked):
        return reference.pick_slots(picked, table, visible)
    return launch_pick_slots(picked, table, visible)


def launch_pick_slots(
    picked: torch.Tensor, table: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it)."""
    rows, k = picked.shape
    out = torch.empty(rows, k, dtype=torch.int32, device=picked.device)
    counts = torch.zeros(rows, dtype=torch.int32, device=picked.device)
    if rows and k:
        _pick_slots[(rows,)](
            picked, table, visible, out, counts, k, picked.stride(0), table.stride(0),
            out.stride(0), BLOCK_K=triton.next_power_of_2(k), num_warps=4, **pdl.options(out),
        )  # fmt: skip
    return out, counts


def launch_window(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int,
) -> WindowIndex:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it)."""
    n, dev = positions.shape[0], positions.device
    indices = torch.empty(n, window, dtype=torch.int32, device=dev)
    slots = torch.empty(n * window, dtype=torch.long, device=dev)
    if n:
        _window_index[(n,)](
            positions, lengths, table_rows, block_tables, indices, slots,
            block_tables.stride(0), block_tables.shape[1], block_size, window,
            BLOCK_W=triton.next_power_of_2(window), num_warps=1, **pdl.options(slots),
        )  # fmt: skip
    return WindowIndex(indices, slots)


def launch_rate(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int,
    rate: int,
    most: int,
    dense: bool,
    scratch_slot: int,
    entries_a_step: int = ENTRIES_A_STEP,
) -> RateIndex:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it)."""
    n, dev = positions.shape[0], positions.device

    def new(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=dev)

    out = RateIndex(
        new(n, most), new(n, most, dtype=torch.int32), new(n), new(n), new(n, 2 * rate),
        new(n, dtype=torch.bool), new(n), new(n), new(n, dtype=torch.bool),
        new(n, window + most, dtype=torch.int32) if dense else None,
    )  # fmt: skip
    if n:
        per_block = block_size // rate
        _rate_index[(n,)](
            positions, lengths, table_rows, block_tables, out.table, out.table32, out.visible,
            out.base, out.input_slots, out.first, out.group_positions, out.entry_slots,
            out.completes, out.table32 if out.dense is None else out.dense,
            block_tables.stride(0), block_tables.shape[1], n, block_size, window, most,
            scratch_slot // block_size * per_block,
            RATE=rate, DENSE=dense, BLOCK_M=min(entries_a_step, triton.next_power_of_2(most)),
            BLOCK_G=triton.next_power_of_2(2 * rate), BLOCK_W=triton.next_power_of_2(window),
            num_warps=4, **pdl.options(positions),
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

    @triton.jit
    def _slot(tab_row, index, per_block, max_cols):  # type: ignore[no-untyped-def]
        """The slots of entries `index` (>= 0) of a row whose block table row is tab_row."""
        col = tl.minimum(index // per_block, max_cols - 1)
        block = tl.load(tab_row + col).to(tl.int64)
        return block * per_block + index % per_block

    @triton.jit  # type: ignore[untyped-decorator]
    def _window_row(i, pos, live, W, BLOCK_W: tl.constexpr):  # type: ignore[no-untyped-def]
        """(j, the row's window key positions, their pool indices: i * W + j, -1: none)."""
        j = tl.arange(0, BLOCK_W)
        keys = pos - W + 1 + j
        return j, keys, tl.where((keys >= 0) & live, i * W + j, -1)

    @triton.jit  # type: ignore[untyped-decorator]
    def _window_index(  # type: ignore[no-untyped-def]
        pos_ptr, len_ptr, trow_ptr, tab_ptr, idx_ptr, slot_ptr, stride_tab, max_cols, BS, W,
        BLOCK_W: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        i = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + i).to(tl.int64)
        live = tl.load(len_ptr + i) > 0
        tab_row = tab_ptr + tl.load(trow_ptr + i).to(tl.int64) * stride_tab
        j, keys, own = _window_row(i, pos, live, W, BLOCK_W)
        in_w = j < W
        tl.store(idx_ptr + i * W + j, own.to(tl.int32), mask=in_w)
        slots = _slot(tab_row, tl.maximum(keys, 0), BS, max_cols)
        tl.store(slot_ptr + i * W + j, slots, mask=in_w)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rate_index(  # type: ignore[no-untyped-def]
        pos_ptr, len_ptr, trow_ptr, tab_ptr, table_ptr, table32_ptr, visible_ptr, base_ptr,
        input_ptr, first_ptr, gpos_ptr, entry_ptr, completes_ptr, dense_ptr, stride_tab,
        max_cols, N, BS, W, MOST, scratch_entry, RATE: tl.constexpr, DENSE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        i = tl.program_id(0).to(tl.int64)
        per_block = BS // RATE
        pos = tl.load(pos_ptr + i).to(tl.int64)
        live = tl.load(len_ptr + i) > 0
        tab_row = tab_ptr + tl.load(trow_ptr + i).to(tl.int64) * stride_tab
        visible = tl.where(live, (pos + 1) // RATE, 0)
        group = tl.where(live, pos // RATE, 0)
        completes = live & ((pos + 1) % RATE == 0)
        base = N * W + i * MOST
        for start in range(0, MOST, BLOCK_M):  # the row's entries, a block at a time
            e = start + tl.arange(0, BLOCK_M)
            table = _slot(tab_row, e, per_block, max_cols)
            tl.store(table_ptr + i * MOST + e, table, mask=e < MOST)
            tl.store(table32_ptr + i * MOST + e, table.to(tl.int32), mask=e < MOST)
            if DENSE:  # every visible entry's pool index, after the window's
                comp = tl.where(e < visible, e + base, -1)
                tl.store(dense_ptr + i * (W + MOST) + W + e, comp.to(tl.int32), mask=e < MOST)
        tl.store(visible_ptr + i, visible)
        tl.store(base_ptr + i, base)
        tl.store(first_ptr + i, group == 0)
        tl.store(gpos_ptr + i, group * RATE)
        tl.store(completes_ptr + i, completes)
        entry = _slot(tab_row, group, per_block, max_cols)
        tl.store(entry_ptr + i, tl.where(completes, entry, scratch_entry))
        t = tl.arange(0, BLOCK_G)
        tokens = tl.maximum((group - 1) * RATE + t, 0)
        tl.store(input_ptr + i * 2 * RATE + t, _slot(tab_row, tokens, BS, max_cols),
                 mask=t < 2 * RATE)
        if DENSE:  # the window's pool indices
            j, _, own = _window_row(i, pos, live, W, BLOCK_W)
            tl.store(dense_ptr + i * (W + MOST) + j, own.to(tl.int32), mask=j < W)

    @triton.jit  # type: ignore[untyped-decorator]
    def _pick_slots(  # type: ignore[no-untyped-def]
        pick_ptr, table_ptr, visible_ptr, out_ptr, count_ptr, K, stride_p, stride_t, stride_o,
        BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    ):
        enter(PDL)
        i = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_K)
        pick = tl.load(pick_ptr + i * stride_p + j, mask=j < K, other=-1).to(tl.int64)
        picked = (pick >= 0) & (pick < tl.load(visible_ptr + i))
        slot = tl.load(table_ptr + i * stride_t + tl.maximum(pick, 0), mask=picked, other=-1)
        tl.store(out_ptr + i * stride_o + j, tl.where(picked, slot, -1).to(tl.int32), mask=j < K)
        tl.store(count_ptr + i, tl.sum(picked.to(tl.int32), axis=0))
    # fmt: on

"""Routed experts with FP8 weights on one grouped persistent Triton GEMM per projection: the
contract of fp8_ref.moe_experts (W8A8: each GEMM's input quantized in 1 x 128 groups, the
experts' weights e4m3 with 128 x 128 scales).

The token -> expert layout is the bf16 experts' (stages.kernels.moe_routing: DeepGEMM's grouped
contiguous one, built on the device with no host sync): the tokens are quantized once
(stages.kernels.triton_fp8_act) and their FP8 rows copied into the layout; the GEMMs walk its M
tiles (the count stays on the device) with a grid of SMs, or SMs - 1 leaving an SM to a waiting
NCCL recv, so a call is sync-free with fixed grids (CUDA graphs capture it). The K loop is
stages.kernels.triton_gemm's block-scaled one: each 128-wide K tile is one activation group and
one weight block. Below SWAPPED_BELOW tokens (a decode step) triton_moe_fp8_decode's kernels
take the layout in 16-row tiles with the experts' weight rows as the MMA's wide side, the same
bits a row. Otherwise, below UNFUSED_SWIGLU_FROM tokens the gate/up GEMM ends in torch_ref.swiglu's
steps (with DeepSeek-V4's clamp where given) and the 1 x 128 quantizer of the down GEMM's input:
each program computes a row tile's gate and up columns of one 128-wide group side by side, so the
bf16 product never goes to memory and only the layout's real rows are written (the expert padding,
most rows of a decode batch's layout, is skipped). Its bits are the unfused path's (the GEMM's
result rounded to the activations' dtype, then triton_fp8_act.swiglu_quantize_act over the layout's
live rows only), which serves more tokens and an intermediate width off the 128 grid. The down GEMM
stores each row at its (token, k) slot, rounded to the activations' dtype as an expert's output is
(fp8_ref.moe_experts); the combine weighs a token's k slots in fp32 and sums them. The GEMMs'
rows are computed alike whatever the batch, so a token's output does not depend on it.

Anything not on CUDA goes to fp8_ref.moe_experts, counted and logged once
(stages/kernels/fallbacks.py); an empty batch does too, uncounted.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.kernels import fp8_ref, pdl, triton_fp8_act, triton_moe_fp8_decode
from stages.kernels.fallbacks import record_fallback
from stages.kernels.moe_routing import Routing, route_and_gather_scaled
from stages.kernels.triton_gemm import num_sms
from stages.kernels.triton_moe_combine import combine

BLOCK = fp8_ref.BLOCK
# (BLOCK_M, warps, stages). Prefill (at least PREFILL_FROM_ROWS rows an expert on average):
# 128-row tiles on 8 warps with 4 stages, PREFILL_PROGRAMS_PER_SM programs an SM, tiles through
# TMA descriptors (PREFILL_TMA). Three 64-row programs an SM (64, 4, 3) were faster on the
# uniform routing of `python -m app.bench.fp8 --moe-loops` (V4-Flash's gate/up + down at 8K
# tokens 2.51 + 1.28 against 2.73 + 1.51 ms on one H100, 2.72 + 1.30 against 2.68 + 1.51 on
# another) but not through the engine: V4-Flash's FP8 TTFT at 256K on one H100 was 3.906 s
# against 3.877 at this launch (five runs each, interleaved; docs/PERFORMANCE.md, session 24).
# Fewer rows (decode): 64-row tiles on 4 warps with 5 stages, one program an SM, pointer loads,
# which stream the expert weights at 3.5-3.7 TB/s at 64 and 512 rows of V4-Flash, against 2.9
# with 3 stages (`python -m app.bench.fp8 --moe-decode-tiles`; 16- and 32-row tiles are no
# faster, nor TMA).
PREFILL_TILES, DECODE_TILES = (128, 8, 4), (64, 4, 5)
PREFILL_FROM_ROWS = 128
PREFILL_PROGRAMS_PER_SM = 1
PREFILL_TMA = True
# The fused gate/up SwiGLU epilogue (gate_up_swiglu) below this many tokens, the GEMM then the
# quantizer from it: same bits, and on an H100 the fused kernel took 0.06 against 0.54 ms at one
# token but 1.51 / 1.94 / 4.33 against 1.43 / 1.82 / 3.44 ms at 64 / 512 / 8192 tokens (`python
# -m app.bench.fp8 --moe-swiglu`, docs/bench/session20/call2/moe_swiglu.json), the quantizer
# then sweeping the layout's expert padding too (it reads only live rows since); between 1 and
# 64 not measured.
UNFUSED_SWIGLU_FROM = 64
# Below this many tokens (a decode step) the experts' weight rows are the MMA's wide side
# (triton_moe_fp8_decode: 16-row tiles, the same bits a row); not with an SM left to NCCL, whose
# persistent grid the swapped kernels do not keep.
SWAPPED_BELOW = 64
# The fused gate/up's launch (warps, stages): gate's and up's columns in one [64, 256] product
# a K step on 8 warps (no spill, 160 KB of shared memory at 4 stages, compiled for sm_90). On an
# H100 it took V4-Flash's FP8 decode step from 2.54 to 2.45 ms at one row and from 9.45 to 8.52
# at 16 against gate then up on 4 warps with 5 stages (docs/PERFORMANCE.md, session 28).
SWIGLU_LAUNCH = (8, 4)


def tiles_for(pairs: int, experts: int) -> tuple[int, int, int]:
    """The tile configuration for `pairs` (token, expert) rows over `experts` (a shape, known
    on the host: a CUDA graph's is fixed)."""
    return PREFILL_TILES if pairs >= PREFILL_FROM_ROWS * experts else DECODE_TILES


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None and torch.cuda.get_device_capability()[0] >= 9


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    down: torch.Tensor,
    d_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fp8_linear: Any = None,
    limit: float | None = None,
) -> torch.Tensor:
    return _moe(x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, limit, sm_margin=0)


def moe_experts_sm1(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    down: torch.Tensor,
    d_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fp8_linear: Any = None,
    limit: float | None = None,
) -> torch.Tensor:
    return _moe(x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, limit, sm_margin=1)


def tma_takes(q: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped_gemm's TMA descriptors can read q [rows, K] and w [E, N, K]: contiguous,
    rows 16-byte aligned (K % 16 for e4m3)."""
    return q.shape[1] % 16 == 0 and q.is_contiguous() and w.is_contiguous()


def grouped_gemm(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    r: Routing,
    grid: int,
    dtype: torch.dtype,
    pairs: int | None = None,
    num_warps: int = DECODE_TILES[1],
    num_stages: int = DECODE_TILES[2],
    tma: bool = False,
) -> torch.Tensor:
    """W8A8 of the layout's rows with their tiles' experts: q [rows, K] fp8 with q_scale
    [rows, K / 128], w [E, N, K] fp8 with w_scale [E, N / 128, K / 128]. Returns c [rows, N]; or,
    given ``pairs``, y [pairs, N]: each row at its pair's slot (the routing weight left to the
    combine).
    tma: q's and w's tiles through Hopper TMA descriptors (the bf16 MoE's way) rather than
    pointer loads (contiguous, rows 16-byte aligned, else ValueError): the same products, summed
    alike."""
    rows, k = q.shape
    experts, n = w.shape[:2]
    out_rows = rows if pairs is None else pairs
    # scattered to pairs: a skipped pick's slot (id -1) stays unwritten; combine skips it
    c = torch.empty(out_rows, n, dtype=dtype, device=q.device)
    ws = w_scale.float().contiguous()
    progs = max(1, min(grid, r.max_tiles * triton.cdiv(n, BLOCK)))
    if tma and not tma_takes(q, w):
        raise ValueError(f"grouped_gemm(tma=True) takes contiguous q, w, K % 16 == 0, got K={k}")
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # w as [E, N, K] tiles of [1, 128, 128]: a tile past N reads zeros, not the next expert
        q_in = TensorDescriptor(q, [rows, k], [k, 1], [r.block_m, BLOCK])
        w_in = TensorDescriptor(w, [experts, n, k], [n * k, k, 1], [1, BLOCK, BLOCK])
    else:
        q_in, w_in = q, w
    _grouped_w8a8[(progs,)](
        q_in,
        q_scale,
        w_in,
        ws,
        c,
        r.tile_expert,
        r.num_tiles,
        r.pair_of_row,
        n,
        k,
        progs,
        q.stride(0),
        q_scale.stride(0),
        w.stride(0),
        w.stride(1),
        ws.stride(0),
        ws.stride(1),
        c.stride(0),
        SCATTER=pairs is not None,
        TMA=tma,
        BLOCK_M=r.block_m,
        BLOCK_N=BLOCK,
        BLOCK_K=BLOCK,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.options(c),
    )
    return c


def gate_up_swiglu(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    r: Routing,
    grid: int,
    dtype: torch.dtype,
    limit: float | None = None,
    num_warps: int = SWIGLU_LAUNCH[0],
    num_stages: int = SWIGLU_LAUNCH[1],
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The down GEMM's input from the layout's rows, in one kernel: q [rows, K] fp8 with
    q_scale [rows, K / 128], gate_up [E, 2I, K] fp8 (gate rows first; I a multiple of 128) with
    gu_scale [E, 2I / 128, K / 128] -> (hq [rows, I] e4m3, hs [rows, I / 128] fp32), the bits of
    swiglu_quantize_act(grouped_gemm(...) in `dtype`, limit) on the real rows; padding rows are
    left unwritten (the down GEMM never stores them); `out`: the two buffers to write."""
    rows, k = q.shape
    inter = gate_up.shape[1] // 2
    if inter % BLOCK:
        raise ValueError(f"gate_up_swiglu takes an intermediate width on the 128 grid, got {inter}")
    if out is None:
        out = (
            torch.empty(rows, inter, dtype=fp8_ref.FP8, device=q.device),
            torch.empty(rows, inter // BLOCK, dtype=torch.float32, device=q.device),
        )
    hq, hs = out
    ws = gu_scale.float().contiguous()
    progs = max(1, min(grid, r.max_tiles * (inter // BLOCK)))
    _grouped_w8a8_swiglu[(progs,)](
        q, q_scale, gate_up, ws, hq, hs, r.tile_expert, r.num_tiles, r.pair_of_row, inter, k,
        progs, q.stride(0), q_scale.stride(0), gate_up.stride(0), gate_up.stride(1), ws.stride(0),
        ws.stride(1), hq.stride(0), hs.stride(0),
        0.0 if limit is None else triton_fp8_act.rounded(limit, dtype),
        HAS_LIMIT=limit is not None, CUDA_EXP=q.is_cuda, H_DTYPE=_TL_DTYPES[dtype],
        INV_FP8_MAX=1 / fp8_ref.FP8_MAX, MIN_SCALE=fp8_ref.MIN_SCALE, BLOCK_M=r.block_m,
        BLOCK_N=BLOCK, BLOCK_K=BLOCK, GROUP_M=8, num_warps=num_warps, num_stages=num_stages,
        **pdl.options(hq),
    )  # fmt: skip
    return hq, hs


def _moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gu_scale: torch.Tensor,
    down: torch.Tensor,
    d_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None,
    sm_margin: int,
) -> torch.Tensor:
    if triton is None or not x.is_cuda or x.shape[0] == 0:
        if x.shape[0]:  # an empty batch is no work either way
            backend = "triton-persistent-sm1" if sm_margin else "triton-persistent"
            reason = "device" if not x.is_cuda else "no_triton"
            record_fallback("moe_experts_fp8", backend, reason, f"{x.device} -> fp8_ref")
        return fp8_ref.moe_experts(
            x, gate_up, gu_scale, down, d_scale, topk_ids, topk_weights, limit=limit
        )
    t, k = topk_ids.shape
    grid = num_sms(x.device) - sm_margin
    tiles = tiles_for(t * k, gate_up.shape[0])
    swapped = t < SWAPPED_BELOW and gate_up.shape[1] % (2 * BLOCK) == 0 and not sm_margin
    block_m = triton_moe_fp8_decode.DECODE_BLOCK_M if swapped else tiles[0]
    xq, xs = triton_fp8_act.quantize_act(x)
    # the FP8 rows travel as bytes (the gather copies them unchanged) with their scales; padding
    # rows stay unwritten: their results are never stored at a pair's slot
    r, a, a_scale = route_and_gather_scaled(
        xq.view(torch.uint8), xs, topk_ids, topk_weights, gate_up.shape[0], block_m
    )
    a = a.view(fp8_ref.FP8)
    if swapped:
        y = triton_moe_fp8_decode.moe(
            a, a_scale, gate_up, gu_scale, down, d_scale, r, x.dtype, limit, t * k
        )
        return combine(y, topk_ids, x.dtype, weights=topk_weights)
    if t < UNFUSED_SWIGLU_FROM and gate_up.shape[1] % (2 * BLOCK) == 0:
        hq, hs = gate_up_swiglu(a, a_scale, gate_up, gu_scale, r, grid, x.dtype, limit)
    else:  # more rows, or a gate/up column group straddling the halves: GEMM, then quantizer
        h = _grouped(a, a_scale, gate_up, gu_scale, r, grid, x.dtype, None, tiles)
        hq, hs = triton_fp8_act.swiglu_quantize_act(h, limit, live=r.pair_of_row)
    y = _grouped(hq, hs, down, d_scale, r, grid, x.dtype, t * k, tiles)
    return combine(y, topk_ids, x.dtype, weights=topk_weights)


def _grouped(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    r: Routing,
    grid: int,
    dtype: torch.dtype,
    pairs: int | None,
    tiles: tuple[int, int, int],
) -> torch.Tensor:
    """grouped_gemm at `tiles` on `grid` SMs, at the prefill tiles PREFILL_PROGRAMS_PER_SM
    programs each and through TMA descriptors where the operands allow them (PREFILL_TMA)."""
    prefill = tiles == PREFILL_TILES
    tma = PREFILL_TMA and prefill and tma_takes(q, w)
    progs = grid * PREFILL_PROGRAMS_PER_SM if prefill else grid
    _, warps, stages = tiles
    return grouped_gemm(q, q_scale, w, w_scale, r, progs, dtype, pairs, warps, stages, tma)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter
    from stages.kernels.triton_fp8_act import _quantize_store, swiglu_steps
    from stages.kernels.triton_gemm import _tile_coords, dot_rows

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _grouped_w8a8(  # type: ignore[no-untyped-def]
        a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, tile_expert_ptr, num_tiles_ptr, pair_ptr,
        N, K, num_progs, stride_am, stride_as, stride_we, stride_wn, stride_wse,
        stride_wsn, stride_cm, SCATTER: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """TMA: a_ptr and w_ptr are descriptors ([rows, K] and [E, N, K]), else pointers."""
        enter(PDL)
        num_pid_m = tl.load(num_tiles_ptr)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w_scales = ws_ptr + expert * stride_wse + pid_n * stride_wsn
            if TMA:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                k_tiles = tl.cdiv(K, BLOCK_K)
                a_scales = as_ptr + rows.to(tl.int64) * stride_as
                a_s_next, w_s_next = tl.load(a_scales), tl.load(w_scales)
                for ki in range(k_tiles):  # dot_rows's K loop (scales a step ahead), TMA tiles
                    a_s, w_s = a_s_next, w_s_next
                    ahead = tl.minimum(ki + 1, k_tiles - 1)
                    a_s_next, w_s_next = tl.load(a_scales + ahead), tl.load(w_scales + ahead)
                    a = a_ptr.load([pid_m * BLOCK_M, ki * BLOCK_K])
                    w = tl.reshape(w_ptr.load([expert.to(tl.int32), pid_n * BLOCK_N,
                                               ki * BLOCK_K]),
                                   (BLOCK_N, BLOCK_K))
                    acc += tl.dot(a, w.T) * (a_s[:, None] * w_s)
            else:
                cols_safe = tl.where(cols < N, cols, 0).to(tl.int64)
                acc = dot_rows(a_ptr, w_ptr + expert * stride_we, as_ptr, w_scales,
                               rows.to(tl.int64), cols_safe, K, stride_am, stride_wn, stride_as,
                               BLOCK_M, BLOCK_N, BLOCK_K, True)
            if SCATTER:
                pair = tl.load(pair_ptr + rows)
                dest = pair.to(tl.int64)
                keep = (pair[:, None] >= 0) & (cols[None, :] < N)
            else:
                dest = rows.to(tl.int64)
                keep = cols[None, :] < N
            c_ptrs = c_ptr + dest[:, None] * stride_cm + cols[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=keep)

    @triton.jit  # type: ignore[untyped-decorator]
    def _grouped_w8a8_swiglu(  # type: ignore[no-untyped-def]
        a_ptr, as_ptr, w_ptr, ws_ptr, q_ptr, qs_ptr, tile_expert_ptr, num_tiles_ptr, pair_ptr,
        INTER, K, num_progs, stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
        stride_qm, stride_qsm, limit, HAS_LIMIT: tl.constexpr, CUDA_EXP: tl.constexpr,
        H_DTYPE: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """For each (M tile, 128-wide column group n): gate = a @ w[n].T and up = a @ w[I/128 +
        n].T (_gate_up_side_by_side: both in one [BLOCK_M, 2 BLOCK_N] product a K step),
        rounded to H_DTYPE, through swiglu_steps, quantized as one 1 x 128 group, stored at the
        tile's real rows."""
        enter(PDL)
        num_pid_m = tl.load(num_tiles_ptr)
        num_pid_n = INTER // BLOCK_N
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
            rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            gate_scales = ws_ptr + expert * stride_wse + pid_n * stride_wsn
            gate, up = _gate_up_side_by_side(
                a_ptr, as_ptr, w_ptr + expert * stride_we, gate_scales,
                gate_scales + num_pid_n * stride_wsn, rows, cols.to(tl.int64), INTER, K,
                stride_am, stride_as, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
            gate, up = gate.to(H_DTYPE), up.to(H_DTYPE)
            h = swiglu_steps(gate, up, limit, HAS_LIMIT, CUDA_EXP)
            real = tl.load(pair_ptr + rows) >= 0
            _quantize_store(h, rows, cols, pid_n, real, real, q_ptr, qs_ptr, INTER, stride_qm,
                            stride_qsm, 1, INV_FP8_MAX, MIN_SCALE)

    @triton.jit  # type: ignore[untyped-decorator]
    def _gate_up_side_by_side(  # type: ignore[no-untyped-def]
        a_ptr, as_ptr, w_ptr, gate_scales, up_scales, rows, cols, INTER, K, stride_am,
        stride_as, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """(gate, up) [BLOCK_M, BLOCK_N] fp32 of rows (int64) at gate columns cols (int64) and
        up columns INTER + cols: dot_rows's K loop (the scales a step ahead) over both at once,
        their columns interleaved, each K step's product scaled per column (the same products
        and sums as dot_rows's, column by column)."""
        both = tl.reshape(tl.join(cols, INTER + cols), (2 * BLOCK_N,))  # g0 u0 g1 u1 ...
        is_gate = (tl.arange(0, 2 * BLOCK_N) % 2) == 0
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        k_tiles = tl.cdiv(K, BLOCK_K)
        a_scales = as_ptr + rows * stride_as
        a_s_next = tl.load(a_scales)
        g_s_next, u_s_next = tl.load(gate_scales), tl.load(up_scales)
        for ki in range(k_tiles):
            a_s, g_s, u_s = a_s_next, g_s_next, u_s_next
            ahead = tl.minimum(ki + 1, k_tiles - 1)
            a_s_next = tl.load(a_scales + ahead)
            g_s_next, u_s_next = tl.load(gate_scales + ahead), tl.load(up_scales + ahead)
            ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = ks[None, :] < K
            a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=kmask, other=0.0)
            w = tl.load(w_ptr + both[:, None] * stride_wn + ks[None, :], mask=kmask, other=0.0)
            w_s = tl.where(is_gate, g_s, u_s)
            acc += tl.dot(a, w.T) * (a_s[:, None] * w_s[None, :])
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        return gate, up
    # fmt: on

"""Routed experts with FP8 weights on one grouped persistent Triton GEMM per projection: the
contract of fp8_ref.moe_experts (W8A8: each GEMM's input quantized in 1 x 128 groups, the
experts' weights e4m3 with 128 x 128 scales).

The token -> expert layout is the bf16 experts' (stages.kernels.moe_routing: DeepGEMM's grouped
contiguous one, built on the device with no host sync): the tokens are quantized once
(stages.kernels.triton_fp8_act) and their FP8 rows copied into the layout; the GEMMs walk its M
tiles (the count stays on the device) with a grid of SMs, or SMs - 1 leaving an SM to a waiting
NCCL recv, so a call is sync-free with fixed grids (CUDA graphs capture it). The K loop is
stages.kernels.triton_gemm's block-scaled one: each 128-wide K tile is one activation group and
one weight block. Between the two the gate/up product goes through torch_ref.swiglu's steps
(with DeepSeek-V4's clamp where given) and is quantized again, in one kernel
(triton_fp8_act.swiglu_quantize_act). The down GEMM scales each row by its
routing weight and stores it at its (token, k) slot, as triton_moe's does; the k slots of a
token are summed.

Anything not on CUDA goes to fp8_ref.moe_experts, counted and logged once
(stages/kernels/fallbacks.py); an empty batch does too, uncounted.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.kernels import fp8_ref, triton_fp8_act
from stages.kernels.fallbacks import record_fallback
from stages.kernels.moe_routing import Routing, route_and_gather_scaled
from stages.kernels.triton_gemm import num_sms
from stages.kernels.triton_moe_combine import combine

BLOCK = fp8_ref.BLOCK
# (BLOCK_M, warps, stages). Prefill (at least 128 rows an expert on average): 128-row tiles on
# 8 warps, 4 stages, 27-30 % faster than 64 on 4 warps at V4-Flash's 8K and V3.2-bench's 4K
# chunks (`python -m app.bench.fp8 --moe-tiles`, docs/PERFORMANCE.md). Fewer rows (decode):
# 64-row tiles on 4 warps with 5 stages in flight, which stream the expert weights at
# 3.5-3.7 TB/s at 64 and 512 rows of V4-Flash, against 2.9 with 3 stages
# (`python -m app.bench.fp8 --moe-decode-tiles`; 16- and 32-row tiles are no faster).
PREFILL_TILES, DECODE_TILES = (128, 8, 4), (64, 4, 5)


def tiles_for(pairs: int, experts: int) -> tuple[int, int, int]:
    """The tile configuration for `pairs` (token, expert) rows over `experts` (a shape, known
    on the host: a CUDA graph's is fixed)."""
    return PREFILL_TILES if pairs >= PREFILL_TILES[0] * experts else DECODE_TILES


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
) -> torch.Tensor:
    """W8A8 of the layout's rows with their tiles' experts: q [rows, K] fp8 with q_scale
    [rows, K / 128], w [E, N, K] fp8 with w_scale [E, N / 128, K / 128]. Returns c [rows, N]; or,
    given ``pairs``, y [pairs, N]: each row times its routing weight at its pair's slot."""
    rows, k = q.shape
    n = w.shape[1]
    out_rows = rows if pairs is None else pairs
    # scattered to pairs: a skipped pick's slot (id -1) stays unwritten; combine skips it
    c = torch.empty(out_rows, n, dtype=dtype, device=q.device)
    ws = w_scale.float().contiguous()
    progs = max(1, min(grid, r.max_tiles * triton.cdiv(n, BLOCK)))
    _grouped_w8a8[(progs,)](
        q,
        q_scale,
        w,
        ws,
        c,
        r.tile_expert,
        r.num_tiles,
        r.pair_of_row,
        r.row_weight,
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
        BLOCK_M=r.block_m,
        BLOCK_N=BLOCK,
        BLOCK_K=BLOCK,
        GROUP_M=8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return c


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
    block_m, warps, stages = tiles_for(t * k, gate_up.shape[0])
    cfg = dict(num_warps=warps, num_stages=stages)
    xq, xs = triton_fp8_act.quantize_act(x)
    # the FP8 rows travel as bytes (the gather copies them unchanged) with their scales; padding
    # rows stay unwritten: their results are never stored at a pair's slot
    r, a, a_scale = route_and_gather_scaled(
        xq.view(torch.uint8), xs, topk_ids, topk_weights, gate_up.shape[0], block_m
    )
    h = grouped_gemm(a.view(fp8_ref.FP8), a_scale, gate_up, gu_scale, r, grid, x.dtype, **cfg)
    hq, hs = triton_fp8_act.swiglu_quantize_act(h, limit)
    y = grouped_gemm(hq, hs, down, d_scale, r, grid, x.dtype, pairs=t * k, **cfg)
    return combine(y, topk_ids, x.dtype)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.triton_gemm import _tile_coords, dot_rows

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _grouped_w8a8(  # type: ignore[no-untyped-def]
        a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, tile_expert_ptr, num_tiles_ptr, pair_ptr,
        weight_ptr, N, K, num_progs, stride_am, stride_as, stride_we, stride_wn, stride_wse,
        stride_wsn, stride_cm, SCATTER: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        num_pid_m = tl.load(num_tiles_ptr)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_progs):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cols_safe = tl.where(cols < N, cols, 0).to(tl.int64)
            acc = dot_rows(a_ptr, w_ptr + expert * stride_we, as_ptr,
                           ws_ptr + expert * stride_wse + pid_n * stride_wsn, rows.to(tl.int64),
                           cols_safe, K, stride_am, stride_wn, stride_as, BLOCK_M, BLOCK_N,
                           BLOCK_K, True)
            if SCATTER:
                pair = tl.load(pair_ptr + rows)
                acc = acc * tl.load(weight_ptr + rows)[:, None]
                dest = pair.to(tl.int64)
                keep = (pair[:, None] >= 0) & (cols[None, :] < N)
            else:
                dest = rows.to(tl.int64)
                keep = cols[None, :] < N
            c_ptrs = c_ptr + dest[:, None] * stride_cm + cols[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=keep)
    # fmt: on

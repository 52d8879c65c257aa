"""The FP8 MoE's grouped W8A8 GEMM in Gluon for Hopper, with each K block's MMA overlapped.

triton_moe_fp8._grouped_w8a8 scales each 128-wide K block's product (activation group scale x
weight block scale) before adding it to the fp32 accumulator, and Triton waits for every
warpgroup MMA before that scaling (`wgmma.wait_group 0`): the tensor cores idle while the CUDA
cores scale (docs/PERFORMANCE.md, "Why the grouped FP8 GEMM stays near 30 %"). Here K block
i + 1's MMA is issued before block i's product is waited for (`warpgroup_mma_wait(
num_outstanding=1)`), so block i is scaled and added while the tensor cores run block i + 1, and
its shared-memory slot takes the load of block i + NUM_STAGES - 1 (TMA, mbarriers) at once.

The products, their scales and the order of the fp32 additions are _grouped_w8a8's (the same
wgmma instruction shape, 16 x BLOCK_N x 32; (a_s * w_s), then the product times it, then the
sum), so the two agree to the bit where ptxas contracts alike (tests/gpu/test_fp8_kernels.py).
Not the default: built without a device (compiled for sm_90 by
tests/cpu/test_triton_compile_sm90.py), to be measured against it (`python -m app.bench.fp8
--moe-tiles` sweeps it as "gluon").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from stages.kernels import fp8_ref
from stages.kernels.gluon_hopper import fp8_layout, is_available
from stages.kernels.moe_routing import Routing

BLOCK = fp8_ref.BLOCK
NUM_STAGES = 4


@functools.lru_cache(maxsize=None)
def kernel() -> Any:
    """The @gluon.jit kernel, built at the first call (Gluon imported only when asked for)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    # fmt: off
    @gluon.jit  # type: ignore[untyped-decorator]
    def grouped_w8a8_overlapped(  # type: ignore[no-untyped-def]
        a_desc, w_desc, as_ptr, ws_ptr, c_ptr, tile_expert_ptr, num_tiles_ptr, pair_ptr,
        weight_ptr, N, K, stride_as, stride_wse, stride_wsn, stride_cm,
        SCATTER: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):
        """One (M tile, N tile) a program: a_desc over the layout's rows [rows, K], w_desc over
        the experts' weights as [E * N, K] rows (N a multiple of BLOCK_N: a tile never crosses
        an expert)."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        num_pid_n = N // BLOCK_N
        pid_m = gl.program_id(0) // num_pid_n
        pid_n = gl.program_id(0) % num_pid_n
        if pid_m < gl.load(num_tiles_ptr):
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32])
            rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
            cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
            expert = gl.load(tile_expert_ptr + pid_m)
            row0 = pid_m * BLOCK_M
            w_row0 = expert * N + pid_n * BLOCK_N
            rows = row0 + gl.arange(0, BLOCK_M, layout=rows_layout)
            w_scales = ws_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn
            a_bufs = gl.allocate_shared_memory(
                a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
            w_bufs = gl.allocate_shared_memory(
                w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(NUM_STAGES):
                mbarrier.init(bars.index(st), count=1)
            tile_bytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
            nk = gl.cdiv(K, BLOCK_K)
            for st in gl.static_range(NUM_STAGES - 1):  # the first blocks in flight
                mbarrier.expect(bars.index(st), tile_bytes, pred=st < nk)
                tma.async_copy_global_to_shared(a_desc, [row0, st * BLOCK_K], bars.index(st),
                                                a_bufs.index(st), pred=st < nk)
                tma.async_copy_global_to_shared(w_desc, [w_row0, st * BLOCK_K], bars.index(st),
                                                w_bufs.index(st), pred=st < nk)
            zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
            last = warpgroup_mma_init(zero)  # block ki - 1's product, in flight
            last_scale = gl.zeros([BLOCK_M], gl.float32, layout=rows_layout)
            for ki in range(nk):
                s = ki % NUM_STAGES
                mbarrier.wait(bars.index(s), (ki // NUM_STAGES) & 1)
                product = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), zero,
                                        use_acc=False, is_async=True)
                # block ki - 1's MMA is done once at most this one is outstanding
                done = warpgroup_mma_wait(num_outstanding=1, deps=(last,))
                refill = ki + NUM_STAGES - 1  # into block ki - 1's slot, free now
                r = refill % NUM_STAGES
                mbarrier.expect(bars.index(r), tile_bytes, pred=refill < nk)
                tma.async_copy_global_to_shared(a_desc, [row0, refill * BLOCK_K], bars.index(r),
                                                a_bufs.index(r), pred=refill < nk)
                tma.async_copy_global_to_shared(w_desc, [w_row0, refill * BLOCK_K],
                                                bars.index(r), w_bufs.index(r), pred=refill < nk)
                a_s = gl.load(as_ptr + rows.to(gl.int64) * stride_as + ki)
                scale = a_s * gl.load(w_scales + ki)
                acc = acc + done * gl.expand_dims(last_scale, 1)
                last = product
                last_scale = scale
            done = warpgroup_mma_wait(num_outstanding=0, deps=(last,))
            acc = acc + done * gl.expand_dims(last_scale, 1)
            for st in gl.static_range(NUM_STAGES):
                mbarrier.invalidate(bars.index(st))
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
            if SCATTER:
                pair = gl.load(pair_ptr + rows)
                acc = acc * gl.expand_dims(gl.load(weight_ptr + rows), 1)
                dest = pair.to(gl.int64)
                keep = gl.expand_dims(pair >= 0, 1) & gl.expand_dims(cols < N, 0)
            else:
                dest = rows.to(gl.int64)
                keep = gl.expand_dims(rows >= 0, 1) & gl.expand_dims(cols < N, 0)
            out = c_ptr + gl.expand_dims(dest * stride_cm, 1) + gl.expand_dims(cols, 0)
            gl.store(out, acc.to(c_ptr.dtype.element_ty), mask=keep)
    # fmt: on

    return grouped_w8a8_overlapped


def refusal(q: torch.Tensor, w: torch.Tensor, r: Routing) -> str | None:
    """Why grouped_gemm cannot take these operands, or None."""
    k, n = q.shape[1], w.shape[1]
    if not is_available():
        return "needs Gluon's Hopper ops on SM90"
    if not (q.is_contiguous() and w.is_contiguous() and k % 16 == 0 and n % BLOCK == 0):
        return f"needs contiguous q, w with K % 16 == 0 and N % {BLOCK} == 0, got K={k}, N={n}"
    if r.block_m not in (64, 128):
        return f"needs 64- or 128-row tiles, got {r.block_m}"
    return None


def grouped_gemm(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    r: Routing,
    dtype: torch.dtype,
    pairs: int | None = None,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """triton_moe_fp8.grouped_gemm's contract (q [rows, K] e4m3 with q_scale [rows, K / 128],
    w [E, N, K] e4m3 with w_scale [E, N / 128, K / 128]; c [rows, N], or with ``pairs`` each
    row times its routing weight at its pair's slot) on 64- or 128-row tiles (4 or 8 warps),
    where `refusal` finds nothing, else ValueError."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, k = q.shape
    experts, n = w.shape[:2]
    refused = refusal(q, w, r)
    if refused is not None:
        raise ValueError(f"the Gluon grouped GEMM {refused}")
    c = torch.empty(rows if pairs is None else pairs, n, dtype=dtype, device=q.device)
    ws = w_scale.float().contiguous()
    a_desc = TensorDescriptor(q, [rows, k], [k, 1], [r.block_m, BLOCK],
                              fp8_layout([r.block_m, BLOCK]))  # fmt: skip
    w_desc = TensorDescriptor(w.view(experts * n, k), [experts * n, k], [k, 1], [BLOCK, BLOCK],
                              fp8_layout([BLOCK, BLOCK]))  # fmt: skip
    kernel()[(r.max_tiles * (n // BLOCK),)](
        a_desc, w_desc, q_scale, ws, c, r.tile_expert, r.num_tiles, r.pair_of_row, r.row_weight,
        n, k, q_scale.stride(0), ws.stride(0), ws.stride(1), c.stride(0),
        SCATTER=pairs is not None, NUM_STAGES=num_stages, num_warps=r.block_m // 16,
    )  # fmt: skip
    return c

"""The indexer's chunk scores over FP8 keys in Gluon for Hopper, each head's MMA overlapped.

triton_indexer's chunk kernel loops over the index heads: per head the [64 tokens x 128 keys]
product of the e4m3 queries and keys, its ReLU times the head's weight, added to the fp32 sum.
Triton waits for every head's warpgroup MMA before that ReLU (`wgmma.wait_group 0`,
docs/PERFORMANCE.md), so the tensor cores idle while the CUDA cores weigh. Here head h + 1's MMA
is issued before head h's product is waited for (`warpgroup_mma_wait(num_outstanding=1)`), the
tile's keys are gathered once into shared memory through the row's slot table, and each head's
queries come by TMA into a ring of NUM_STAGES slots.

The products, the order of the additions (head 0 first), the key scales after the head sum and
the -inf mask are the Triton kernel's (`KEY_FP8`), so the two agree to the bit where ptxas
contracts alike (tests/gpu/test_indexer_kernel.py). Chunk rows over FP8 keys only; not the
default: built without a device (compiled for sm_90 by tests/cpu/test_gluon_compile_sm90.py),
to be measured against the Triton kernel (`python -m app.bench.indexer --gluon`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from stages.kernels.gluon_hopper import fp8_layout

NUM_STAGES = 3
BLOCK_T, BLOCK_L = 64, 128  # tokens of a row x keys a program (indexer_select.CHUNK_TILE rows)
# two warpgroups, each the 64 tokens x 64 of the keys: 32 fp32 of a product a thread, so three
# (the sum, the product waited for, the one in flight) fit the registers; one warpgroup
# (64 x 128 each) spilled
WARPS = 8


@functools.lru_cache(maxsize=None)
def kernel() -> Any:
    """The @gluon.jit kernel, built at the first call (Gluon imported only when asked for)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    # fmt: off
    @gluon.jit  # type: ignore[untyped-decorator]
    def chunk_scores_fp8(  # type: ignore[no-untyped-def]
        q_desc, K, KS, W, SLOTS, VISIBLE, TILES, OUT, LMAX, ENTRIES, stride_kb, stride_sb,
        stride_wt, stride_sr, stride_ot, HEADS: gl.constexpr, BL: gl.constexpr,
        NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):
        """A program: up to BT tokens of one row (TILES: row, first token, count) x BL of its
        keys. q_desc: the e4m3 queries as [tokens, HEADS * D], a [BT, D] block a head."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        # BT = 64 rows are one warpgroup's: more warps split the keys (n = BL / groups each)
        groups: gl.constexpr = num_warps // 4
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, BL // groups, 32])
        t_layout: gl.constexpr = gl.SliceLayout(1, mma)
        l_layout: gl.constexpr = gl.SliceLayout(0, mma)
        tile = gl.program_id(0)
        row = gl.load(TILES + tile * 3).to(gl.int64)
        first = gl.load(TILES + tile * 3 + 1)
        count = gl.load(TILES + tile * 3 + 2)
        rel = gl.arange(0, BT, layout=t_layout)
        t_mask = rel < count
        offs_t = (first + rel).to(gl.int64)
        visible = gl.load(VISIBLE + offs_t, mask=t_mask, other=0)
        seen = gl.max(visible, 0)
        if gl.program_id(1) * BL >= seen:  # no token of the tile sees this block
            offs_l = gl.program_id(1) * BL + gl.arange(0, BL, layout=l_layout)
            gl.store(OUT + gl.expand_dims(offs_t * stride_ot, 1) + gl.expand_dims(offs_l, 0),
                     gl.full([BT, BL], float("-inf"), gl.float32, layout=mma),
                     mask=gl.expand_dims(t_mask, 1) & gl.expand_dims(offs_l < LMAX, 0))
        else:
            # the block's keys, gathered through the row's slots into shared memory, [BL, D]
            k_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
            kl = gl.program_id(1) * BL + gl.arange(0, BL, layout=gl.SliceLayout(1, k_layout))
            kd = gl.arange(0, D, layout=gl.SliceLayout(0, k_layout))
            k_slots = gl.load(SLOTS + row * stride_sr + kl, mask=kl < seen, other=0).to(gl.int64)
            k_block = k_slots // ENTRIES
            k_rows = k_block * stride_kb + (k_slots - k_block * ENTRIES) * D
            keys = gl.load(K + gl.expand_dims(k_rows, 1) + gl.expand_dims(kd, 0),
                           mask=gl.expand_dims(kl < seen, 1), other=0.0)
            k_smem = gl.allocate_shared_memory(
                K.dtype.element_ty, [BL, D],
                gl.NVMMASharedLayout.get_default_for([BL, D], K.dtype.element_ty), keys)
            fence_async_shared()  # the MMAs read it through the async proxy,
            gl.thread_barrier()  # once every warp has written its part
            q_bufs = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES, BT, D], q_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(NUM_STAGES):
                mbarrier.init(bars.index(st), count=1)
            for st in gl.static_range(NUM_STAGES - 1):  # the first heads' queries in flight
                mbarrier.expect(bars.index(st), BT * D, pred=st < HEADS)
                tma.async_copy_global_to_shared(q_desc, [first, st * D], bars.index(st),
                                                q_bufs.index(st), pred=st < HEADS)
            zero = gl.zeros([BT, BL], gl.float32, layout=mma)
            acc = gl.zeros([BT, BL], gl.float32, layout=mma)
            last = warpgroup_mma_init(zero)  # head h - 1's product, in flight
            last_w = gl.zeros([BT], gl.float32, layout=t_layout)
            for h in range(HEADS):
                s = h % NUM_STAGES
                mbarrier.wait(bars.index(s), (h // NUM_STAGES) & 1)
                product = warpgroup_mma(q_bufs.index(s), k_smem.permute((1, 0)), zero,
                                        use_acc=False, is_async=True)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(last,))
                refill = h + NUM_STAGES - 1  # into head h - 1's slot, read by now
                r = refill % NUM_STAGES
                mbarrier.expect(bars.index(r), BT * D, pred=refill < HEADS)
                tma.async_copy_global_to_shared(q_desc, [first, refill * D], bars.index(r),
                                                q_bufs.index(r), pred=refill < HEADS)
                w = gl.load(W + offs_t * stride_wt + h, mask=t_mask, other=0.0)
                acc = acc + gl.maximum(done, 0.0) * gl.expand_dims(last_w, 1)
                last = product
                last_w = w
            done = warpgroup_mma_wait(num_outstanding=0, deps=(last,))
            acc = acc + gl.maximum(done, 0.0) * gl.expand_dims(last_w, 1)
            for st in gl.static_range(NUM_STAGES):
                mbarrier.invalidate(bars.index(st))
            # each key's scale after the head sum (a positive power of two), as the Triton kernel
            offs_l = gl.program_id(1) * BL + gl.arange(0, BL, layout=l_layout)
            l_mask = offs_l < seen
            slots = gl.load(SLOTS + row * stride_sr + offs_l, mask=l_mask, other=0).to(gl.int64)
            block = slots // ENTRIES
            scale = gl.load(KS + block * stride_sb + (slots - block * ENTRIES), mask=l_mask,
                            other=0.0)
            acc = acc * gl.expand_dims(scale, 0)
            seen_by = gl.expand_dims(offs_l, 0) < gl.expand_dims(visible, 1)
            acc = gl.where(seen_by, acc, float("-inf"))
            gl.store(OUT + gl.expand_dims(offs_t * stride_ot, 1) + gl.expand_dims(offs_l, 0), acc,
                     mask=gl.expand_dims(t_mask, 1) & gl.expand_dims(offs_l < LMAX, 0))
    # fmt: on

    return chunk_scores_fp8


def chunk_scores(
    q: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    plan: Any,
    out: torch.Tensor,
    entries: int,
    stride_kb: int,
    stride_sb: int,
    num_stages: int = NUM_STAGES,
) -> None:
    """The chunk rows' scores into `out` [Ts, Lmax], as triton_indexer's chunk kernel writes them
    under an FP8 cache: q [Ts, H, D] e4m3 contiguous (quantize_queries'), values / scales the
    key pages' (triton_indexer._key_views), weights [Ts, H] fp32 (scaled)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from stages.kernels import indexer_select

    if indexer_select.CHUNK_TILE != BLOCK_T:  # the MMA layout is one warpgroup's 64 rows
        raise ValueError(f"the Gluon chunk scores take {BLOCK_T}-token tiles, "
                         f"got {indexer_select.CHUNK_TILE}")  # fmt: skip
    ts, heads, dim = q.shape
    lmax = plan.key_slots.shape[1]
    flat = q.view(ts, heads * dim)
    q_desc = TensorDescriptor(flat, [ts, heads * dim], [heads * dim, 1], [BLOCK_T, dim],
                              fp8_layout([BLOCK_T, dim]))  # fmt: skip
    grid = (plan.chunk_tiles.shape[0], -(-lmax // BLOCK_L))
    kernel()[grid](
        q_desc, values, scales, weights, plan.key_slots, plan.visible, plan.chunk_tiles, out,
        lmax, entries, stride_kb, stride_sb, weights.stride(0), plan.key_slots.stride(0),
        out.stride(0), HEADS=heads, BL=BLOCK_L, NUM_STAGES=num_stages, num_warps=WARPS,
    )  # fmt: skip

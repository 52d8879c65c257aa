"""Paged decode attention in Triton: one query token per row, K/V read in place through the
block table, GQA-native, CUDA-graph safe (every shape is static; lengths are read on device).

Split-KV ("flash decoding"): each (row, KV head) is cut into ``num_splits`` ranges of pages,
each program keeps an online softmax over its range, and a second kernel merges the ranges by
log-sum-exp. The split count is fixed per launch shape, so a graph captured for a batch size
replays whatever the rows' lengths are; rows of length 0 (a graph's padding) give zeros.

Imports cleanly without triton or CUDA: triton is imported lazily.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def is_available(device: str) -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels() -> tuple[Any, Any]:  # Triton JITFunctions (untyped)
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def split_kernel(Q, K, V, TABLES, TABLE_ROWS, LENS, O_PART, LSE_PART, scale,  # type: ignore[no-untyped-def]
                     stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                     stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                     GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     IEEE: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(LENS + row).to(tl.int32)
        table_row = tl.load(TABLE_ROWS + row).to(tl.int64)
        num_pages = tl.cdiv(length, PAGE)
        per_split = tl.cdiv(num_pages, NUM_SPLITS)
        first = split * per_split
        last = tl.minimum(first + per_split, num_pages)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, PAGE)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for page in range(first, last):
            block = tl.load(TABLES + table_row * stride_tb + page).to(tl.int64)
            pos = page * PAGE + offs_n
            n_mask = pos < length
            slots = block * PAGE + offs_n
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(n_mask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        empty = denom == 0.0
        out = acc / tl.where(empty, 1.0, denom)[:, None]
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, denom)))
        o_ptr = (O_PART + row * stride_ob + heads[:, None] * stride_oh + split * stride_os
                 + offs_d[None, :])
        tl.store(o_ptr, out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(LSE_PART + row * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
    # fmt: on

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def merge_kernel(O_PART, LSE_PART, OUT, stride_ob, stride_oh, stride_os, stride_lb,  # type: ignore[no-untyped-def]
                     stride_lh, stride_out_b, stride_out_h, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        lse = tl.load(LSE_PART + row * stride_lb + head * stride_lh + offs_s, mask=s_mask,
                      other=float("-inf"))
        m = tl.max(lse, 0)
        finite = m > float("-inf")
        w = tl.where(s_mask & finite, tl.exp(lse - tl.where(finite, m, 0.0)), 0.0)
        parts = tl.load(O_PART + row * stride_ob + head * stride_oh
                        + offs_s[:, None] * stride_os + offs_d[None, :],
                        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        total = tl.sum(w, 0)
        out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(OUT + row * stride_out_b + head * stride_out_h + offs_d,
                 out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
    # fmt: on

    return split_kernel, merge_kernel


def num_splits_for(rows: int, kv_heads: int, num_sms: int | None = None) -> int:
    """Enough page ranges that rows x KV heads x splits covers the chip about twice."""
    if num_sms is None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        num_sms = props.multi_processor_count
    return max(1, min(32, -(-2 * num_sms // max(1, rows * kv_heads))))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    table_rows: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_size: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [R, Hq, D] (one token per row); k/v_cache [slots, Hkv, D] (a layer of the paged cache,
    slot = block * block_size + offset); block_tables [N, max_blocks] (int32/64) with row r's
    table at block_tables[table_rows[r]]; lengths [R]: keys row r attends to (0: output 0).
    Returns [R, Hq, D] in q's dtype."""
    split_kernel, merge_kernel = _kernels()
    rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not share {hkv} KV heads evenly")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"paged decode needs a power-of-two block size >= 16, got {block_size}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged decode needs a contiguous head dimension")
    group = hq // hkv
    splits = num_splits or num_splits_for(rows, hkv)
    o_part = torch.empty(rows, hq, splits, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(rows, hq, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = _next_pow2(d)
    split_kernel[(rows, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        table_rows,
        lengths,
        o_part,
        lse_part,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        GROUP=group,
        BLOCK_G=max(16, _next_pow2(group)),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        PAGE=block_size,
        NUM_SPLITS=splits,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    merge_kernel[(rows, hq)](
        o_part,
        lse_part,
        out,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        BLOCK_S=_next_pow2(splits),
        num_warps=4,
    )
    return out

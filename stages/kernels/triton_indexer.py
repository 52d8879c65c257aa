"""DeepSeek-V3.2's lightning-indexer scores in one Triton kernel (torch_ref.indexer_logits's
contract): logits[t, l] = sum_h weights[t, h] * relu(scale * q[t, h] . k[l]).

Each program owns a tile of queries x keys and loops over the index heads, so the [T, heads, L]
products the torch reference materialises tile by tile never leave registers. q and k are read
in their own dtype (bf16 on the GPU: tensor cores), accumulated in fp32. DeepGEMM's
fp8_mqa_logits is the FP8 version of the same computation; it does not load on this host.

``indexer_logits_rows`` scores every selecting row of a batch in one launch
(stages.kernels.indexer_select): a program takes a tile of a row's tokens (the index heads of
those tokens are the MMA's rows) against a block of that row's keys, read from the paged cache
through the row's slot table; keys a token does not see are -inf.

Imports cleanly without triton or CUDA: triton is imported lazily.
"""

from __future__ import annotations

import functools

import torch

from stages.kernels import triton_paged_decode

BLOCK_T, BLOCK_L = 64, 128


def is_available(device: str) -> bool:
    return triton_paged_decode.is_available(device)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def logits_kernel(Q, K, W, OUT, T, L, scale, stride_qt, stride_qh, stride_kl, stride_wt,
                      stride_ot, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BT: tl.constexpr, BL: tl.constexpr):
        t0 = tl.program_id(0) * BT
        l0 = tl.program_id(1) * BL
        offs_t = t0 + tl.arange(0, BT)
        offs_l = l0 + tl.arange(0, BL)
        offs_d = tl.arange(0, HEAD_DIM)
        t_mask = offs_t < T
        l_mask = offs_l < L
        k = tl.load(K + offs_l[None, :] * stride_kl + offs_d[:, None],
                    mask=l_mask[None, :], other=0.0)  # [D, BL]
        acc = tl.zeros([BT, BL], tl.float32)
        for h in range(HEADS):
            q = tl.load(Q + offs_t[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=t_mask[:, None], other=0.0)  # [BT, D]
            s = tl.maximum(tl.dot(q, k) * scale, 0.0)
            w = tl.load(W + offs_t * stride_wt + h, mask=t_mask, other=0.0)
            acc += s * w[:, None]
        tl.store(OUT + offs_t[:, None] * stride_ot + offs_l[None, :], acc,
                 mask=t_mask[:, None] & l_mask[None, :])

    return logits_kernel


ROWS_BLOCK_L = 64


@functools.lru_cache(maxsize=None)
def _rows_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rows_kernel(Q, K, W, SLOTS, VISIBLE, TILES, OUT, LMAX, scale, stride_qt, stride_qh,
                    stride_k, stride_wt, stride_sr, stride_ot, HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, G: tl.constexpr, BL: tl.constexpr):
        tile = tl.program_id(0)
        row = tl.load(TILES + tile * 3)
        first = tl.load(TILES + tile * 3 + 1)
        count = tl.load(TILES + tile * 3 + 2)
        gs = tl.arange(0, G)
        tok_ok = gs < count
        toks = (first + gs).to(tl.int64)
        visible = tl.load(VISIBLE + toks, mask=tok_ok, other=0)
        cols = tl.program_id(1) * BL + tl.arange(0, BL)
        out_ptrs = OUT + toks[:, None] * stride_ot + cols[None, :]
        store_mask = tok_ok[:, None] & (cols[None, :] < LMAX)
        seen = tl.max(visible, 0)
        if tl.program_id(1) * BL >= seen:  # no token of the tile sees this block
            tl.store(out_ptrs, tl.full((G, BL), float("-inf"), tl.float32), mask=store_mask)
        else:
            key_ok = cols < seen
            slots = tl.load(SLOTS + row.to(tl.int64) * stride_sr + cols, mask=key_ok, other=0)
            ds = tl.arange(0, HEAD_DIM)
            k = tl.load(K + slots.to(tl.int64)[None, :] * stride_k + ds[:, None],
                        mask=key_ok[None, :], other=0.0)  # [D, BL]
            hs = tl.arange(0, HEADS)
            q = tl.load(Q + toks[:, None, None] * stride_qt + hs[None, :, None] * stride_qh
                        + ds[None, None, :], mask=tok_ok[:, None, None], other=0.0)
            s = tl.dot(tl.reshape(q, (G * HEADS, HEAD_DIM)), k)
            s = tl.reshape(tl.maximum(s * scale, 0.0), (G, HEADS, BL))
            w = tl.load(W + toks[:, None] * stride_wt + hs[None, :], mask=tok_ok[:, None],
                        other=0.0)
            logit = tl.sum(s * w[:, :, None], 1)
            logit = tl.where(cols[None, :] < visible[:, None], logit, float("-inf"))
            tl.store(out_ptrs, logit, mask=store_mask)

    return rows_kernel


def indexer_logits_rows(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                        scale: float, plan) -> torch.Tensor:
    """indexer_select.logits_rows_reference's contract: q [Ts, Hi, D], keys [slots, D] (the flat
    cache), weights [Ts, Hi], plan -> [Ts, Lmax] fp32 (-inf where a token does not see a key)."""
    ts, heads, dim = q.shape
    lmax = plan.key_slots.shape[1]
    # the MMA's rows are a tile's tokens x heads: at least 16, a power of two
    if (dim not in (64, 128) or heads & (heads - 1) or plan.group * heads < 16
            or keys.dtype != q.dtype):
        from stages.kernels import indexer_select

        return indexer_select.logits_rows_reference(q, keys, weights, scale, plan)
    q = q.contiguous()
    weights = weights.float().contiguous()
    out = torch.empty(ts, lmax, dtype=torch.float32, device=q.device)
    grid = (plan.tiles.shape[0], -(-lmax // ROWS_BLOCK_L))
    _rows_kernel()[grid](q, keys, weights, plan.key_slots, plan.visible, plan.tiles, out, lmax,
                         scale, q.stride(0), q.stride(1), keys.stride(0), weights.stride(0),
                         plan.key_slots.stride(0), out.stride(0), HEADS=heads, HEAD_DIM=dim,
                         G=plan.group, BL=ROWS_BLOCK_L, num_warps=8 if plan.group > 1 else 4)
    return out


def indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, Hi, D], k [L, D], weights [T, Hi] fp32 -> [T, L] fp32 (no causal mask)."""
    t, heads, dim = q.shape
    length = k.shape[0]
    if dim not in (64, 128) or k.dtype != q.dtype:
        from stages.kernels import torch_ref

        return torch_ref.indexer_logits(q, k, weights, scale)
    q, k = q.contiguous(), k.contiguous()
    weights = weights.float().contiguous()
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    grid = (-(-t // BLOCK_T), -(-length // BLOCK_L))
    _kernel()[grid](q, k, weights, out, t, length, scale, q.stride(0), q.stride(1),
                    k.stride(0), weights.stride(0), out.stride(0), HEADS=heads,
                    HEAD_DIM=dim, BT=BLOCK_T, BL=BLOCK_L)
    return out

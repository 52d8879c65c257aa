"""DeepSeek-V3.2's lightning-indexer scores in one Triton kernel (torch_ref.indexer_logits's
contract): logits[t, l] = sum_h weights[t, h] * relu(scale * q[t, h] . k[l]).

Each program owns a tile of queries x keys and loops over the index heads, so the [T, heads, L]
products the torch reference materialises tile by tile never leave registers. q and k are read
in their own dtype (bf16 on the GPU: tensor cores), accumulated in fp32. DeepGEMM's
fp8_mqa_logits is the FP8 version of the same computation; it does not load on this host.

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

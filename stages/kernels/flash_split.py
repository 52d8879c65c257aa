"""Chunk attention on flash kernels: bottom-right causal as (prefix, no mask) + (diagonal block,
causal), merged by log-sum-exp.

PyTorch sends `causal_lower_right` with q shorter than k to the memory-efficient kernel (flash
only aligns top-left), which at 128K tokens, where attention is most of the work, costs a lot.
Split the keys: the prefix before the chunk is fully visible to every query, and the chunk's own
block is square, where top-left and bottom-right agree. Each half runs on flash and returns its
log-sum-exp; the halves merge exactly.
"""

from __future__ import annotations

import torch


def is_available(device: str) -> bool:
    return (str(device).startswith("cuda") and torch.cuda.is_available()
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"))


def _partial(q, k, v, causal: bool, scale: float):
    """q [1,H,t,D], k/v [1,H,L,D] -> (out [1,H,t,D], lse [1,H,t] float32)."""
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1]
    # Math version of the same contract, so the split-and-merge is testable on CPU.
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        t, length = s.shape[-2:]
        s = s.masked_fill(torch.ones(t, length, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), v.to(acc)).to(q.dtype), lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as the torch reference: q [t,Hq,D], k/v [L,Hkv,D], bottom-right causal."""
    t, hq, _ = q.shape
    length, hkv, _ = k.shape
    if t > length:
        raise ValueError(f"{t} queries attend to a prefix of only {length} keys")
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    if t == length:
        out, _ = _partial(q_, k_, v_, True, scale)
    elif t == 1:
        out, _ = _partial(q_, k_, v_, False, scale)
    else:
        p = length - t
        o1, lse1 = _partial(q_, k_[:, :, :p], v_[:, :, :p], False, scale)
        o2, lse2 = _partial(q_, k_[:, :, p:], v_[:, :, p:], True, scale)
        lse = torch.logaddexp(lse1, lse2)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = (o1.to(acc) * torch.exp(lse1 - lse).unsqueeze(-1).to(acc)
               + o2.to(acc) * torch.exp(lse2 - lse).unsqueeze(-1).to(acc)).to(q.dtype)
    return out[0].transpose(0, 1)

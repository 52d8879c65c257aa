"""Torch reference kernels: what CPU runs and what every GPU backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def is_available(device: str) -> bool:
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: q [t, Hq, D] (the row's new tokens), k/v [L, Hkv, D] (its whole prefix, t <= L).

    Query i sits at position L - t + i and sees keys 0..L-t+i: the causal mask is aligned to the
    bottom right. `is_causal=True` would align it top-left, wrong for every chunk after the first.
    """
    t, length = q.shape[0], k.shape[0]
    if t > length:
        raise ValueError(f"{t} queries attend to a prefix of only {length} keys")
    q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, seq, D]
    mask = causal_lower_right(t, length) if t > 1 else None  # one query sees every key
    # GQA: query head h reads KV head h // (Hq / Hkv), shared in place instead of repeated.
    out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """R rows of one query each: q [R, Hq, D], k/v [R, Lmax, Hkv, D] padded, mask [R, Lmax]
    (True = a real key). The query heads sharing a KV head are laid out as that head's queries
    ([R, Hkv, Hq/Hkv, D]), so GQA needs no KV repeat and no causal mask (all keys are past)."""
    r, hq, d = q.shape
    hkv = k.shape[2]
    q_ = q.view(r, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(q_, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(r, hq, d)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, table_rows: torch.Tensor,
                           lengths: torch.Tensor, scale: float, block_size: int,
                           num_splits: int | None = None) -> torch.Tensor:
    """The oracle of the paged decode kernels (same arguments; num_splits is ignored): each
    row's keys gathered through its block table, then plain attention. Rows of length 0 give 0.
    """
    out = torch.zeros_like(q)
    for r in range(q.shape[0]):
        length = int(lengths[r])
        if length == 0:
            continue
        table = block_tables[int(table_rows[r])].long()
        pos = torch.arange(length, device=q.device)
        slots = table[pos // block_size] * block_size + pos % block_size
        out[r] = attention(q[r:r + 1], k_cache[slots], v_cache[slots], scale)[0]
    return out


def mla_decode(q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
               seqlens: torch.Tensor, dv: int, scale: float, state: dict) -> torch.Tensor:
    """Absorbed MLA decode, one query per row: q [R, H, Dk] against the latent pages
    [blocks, B, 1, Dk] (keys: all Dk values; values: the first dv) of each row's first
    seqlens[r] slots through its block table [R, max_blocks]. Returns [R, H, dv] in fp32."""
    b = pages.shape[1]
    slots = (block_table.long()[:, :, None] * b
             + torch.arange(b, device=q.device)[None, None, :]).reshape(q.shape[0], -1)
    width = int(seqlens.max())
    slots = slots[:, :width]
    mask = torch.arange(width, device=q.device)[None, :] < seqlens[:, None]
    latent = pages.view(-1, pages.shape[-1]).index_select(0, slots.reshape(-1)).view(
        *slots.shape, 1, -1).to(q.dtype)  # [R, L, 1, Dk]
    k = latent.transpose(1, 2)  # [R, 1, L, Dk]: one head shared by every query head
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.expand(-1, q.shape[1], -1, -1),
                                         k[..., :dv].expand(-1, q.shape[1], -1, -1),
                                         attn_mask=mask[:, None, None, :], scale=scale)
    return out.squeeze(2).float()


def mla_sparse(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dv: int,
               scale: float) -> torch.Tensor:
    """Top-k sparse MLA in the absorbed form: q [T, H, Dk] against the keys kv [slots, 1, Dk]
    named by indices [T, topk] (slot ids, -1 = none; values: the first dv of each key).
    A row with no key gives 0. Returns [T, H, dv] in q's dtype; rows go in slices so the
    gathered keys stay small."""
    out = q.new_zeros(q.shape[0], q.shape[1], dv)
    flat = kv.view(kv.shape[0], kv.shape[-1])
    for start in range(0, q.shape[0], 64):
        idx = indices[start:start + 64].long()
        valid = idx >= 0
        keys = flat.index_select(0, idx.clamp_min(0).reshape(-1)).view(*idx.shape, -1).float()
        s = torch.einsum("thd,tkd->thk", q[start:start + 64].float(), keys) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all -inf (no key): zeros
        out[start:start + 64] = torch.einsum("thk,tkd->thd", p, keys[..., :dv]).to(q.dtype)
    return out


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Routed experts: x [T, H], gate_up [E, 2I, H], down [E, H, I], ids/weights [T, k] ->
    sum over each token's k experts of weight * down(silu(gate) * up), [T, H]. One GEMM pair
    per expert that received tokens."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        start += n
        tokens = sel // k
        gate, up = F.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tokens, y.float() * weights[sel, None])
    return out.to(x.dtype)

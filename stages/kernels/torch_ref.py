"""Torch reference kernels: what CPU runs and what every GPU backend is tested against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def is_available(device: str) -> bool:
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: q [t, Hq, D] (the row's new tokens), k/v [L, Hkv, D] (its whole prefix, t <= L).

    Query i sits at position L - t + i and sees keys 0..L-t+i: the causal mask is aligned to the
    bottom right. `is_causal=True` would align it top-left, wrong for every chunk after the first.
    v may be narrower than q/k (MLA: 128 vs 192): on CUDA it is zero-padded to their width,
    which SDPA's flash kernel needs (its other kernels are slower and fail on long prefixes).
    """
    t, length = q.shape[0], k.shape[0]
    if t > length:
        raise ValueError(f"{t} queries attend to a prefix of only {length} keys")
    dv = v.shape[-1]
    if q.is_cuda and dv < q.shape[-1]:
        return attention(q, k, F.pad(v, (0, q.shape[-1] - dv)), scale)[..., :dv]
    q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, seq, D]
    mask = _lower_right(t, length, q.device) if t > 1 else None  # one query sees every key
    # GQA: query head h reads KV head h // (Hq / Hkv), shared in place instead of repeated.
    out = F.scaled_dot_product_attention(
        q_, k_, v_, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)


def _lower_right(t: int, length: int, device: torch.device) -> torch.Tensor | Any:
    """The bottom-right causal mask: on CUDA torch's CausalBias, which SDPA runs on its flash or
    memory-efficient kernels (imported here: torch.nn.attention.bias imports torch._dynamo, ~1.7 s
    of every process's start on 2 cores); elsewhere the boolean mask CausalBias materializes off
    CUDA, the same bits."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(t, length)
    return torch.ones(t, length, dtype=torch.bool, device=device).tril(length - t)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """R rows of one query each: q [R, Hq, D], k/v [R, Lmax, Hkv, D] padded, mask [R, Lmax]
    (True = a real key). The query heads sharing a KV head are laid out as that head's queries
    ([R, Hkv, Hq/Hkv, D]), so GQA needs no KV repeat and no causal mask (all keys are past)."""
    r, hq, d = q.shape
    hkv = k.shape[2]
    q_ = q.view(r, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(
        q_, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale
    )
    return out.reshape(r, hq, d)


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
        out[r] = attention(q[r : r + 1], k_cache[slots], v_cache[slots], scale)[0]
    return out


def mla_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    dv: int,
    scale: float,
    state: dict[str, Any],
) -> torch.Tensor:
    """Absorbed MLA decode, one query per row: q [R, H, Dk] against the latent pages
    [blocks, B, 1, Dk] (keys: all Dk values; values: the first dv) of each row's first
    seqlens[r] slots through its block table [R, max_blocks]. Returns [R, H, dv] in fp32."""
    b = pages.shape[1]
    slots = (
        block_table.long()[:, :, None] * b + torch.arange(b, device=q.device)[None, None, :]
    ).reshape(q.shape[0], -1)
    width = int(seqlens.max())
    slots = slots[:, :width]
    mask = torch.arange(width, device=q.device)[None, :] < seqlens[:, None]
    latent = (
        pages.view(-1, pages.shape[-1])
        .index_select(0, slots.reshape(-1))
        .view(*slots.shape, 1, -1)
        .to(q.dtype)
    )  # [R, L, 1, Dk]
    k = latent.transpose(1, 2)  # [R, 1, L, Dk]: one head shared by every query head
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.expand(-1, q.shape[1], -1, -1),
        k[..., :dv].expand(-1, q.shape[1], -1, -1),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return out.squeeze(2).float()


# Elements of the fp32 temporaries one tile of the sparse references materialises: they run
# over whole long-prompt chunks, whose full score tensors would not fit.
TILE_ELEMENTS = 1 << 26


def mla_sparse(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dv: int, scale: float
) -> torch.Tensor:
    """Sparse MLA in the absorbed form (FlashMLA's flash_mla_sparse_fwd contract): query t
    attends to the keys kv[indices[t]] only, one latent head shared by every query head; keys
    are all d_qk values, values the first dv. q [T, H, d_qk], kv [slots, 1, d_qk],
    indices [T, K] int32 (-1: no key) -> [T, H, dv] in q's dtype; a query with no key gets 0."""
    t, _, d = q.shape
    flat = kv.view(-1, kv.shape[-1])
    out = q.new_empty(t, q.shape[1], dv)
    step = max(1, TILE_ELEMENTS // max(1, indices.shape[1] * d))
    for i in range(0, t, step):
        idx = indices[i : i + step].long()
        keys = flat.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, d).float()
        scores = torch.einsum("thd,tkd->thk", q[i : i + step].float(), keys) * scale
        scores = scores.masked_fill((idx < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).nan_to_num(0.0)  # all -inf: softmax gives NaN
        out[i : i + step] = torch.einsum("thk,tkv->thv", probs, keys[..., :dv]).to(q.dtype)
    return out


def indexer_logits(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float
) -> torch.Tensor:
    """DeepSeek-V3.2's lightning-indexer scores, in transformers' order of operations:
    logits[t, l] = sum_h weights[t, h] * relu(scale * q[t, h] . k[l]).
    q [T, Hi, D], k [L, D], weights [T, Hi] fp32 -> [T, L] fp32 (no causal mask: the caller's).
    A query's scores are one [Hi, D] x [D, L] product of their own (a batched GEMM over the
    queries), so they do not depend on how many queries share a tile: a GEMM folded over the
    tile's rows rounds a row by the tile's height on some CPUs (AVX-512 MKL kernels)."""
    t, heads, dim = q.shape
    k_t = k.float().T
    out = torch.empty(t, k.shape[0], dtype=torch.float32, device=q.device)
    step = max(1, TILE_ELEMENTS // max(1, heads * k.shape[0]))
    for i in range(0, t, step):
        tile = q[i : i + step].float()
        keys = k_t.expand(tile.shape[0], dim, k.shape[0])
        scores = torch.relu(torch.bmm(tile, keys) * scale)  # [n, Hi, L]
        out[i : i + step] = torch.bmm(weights[i : i + step, None, :].float(), scores)[:, 0]
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a limit (DeepSeek-V4's swiglu_limit) gate is clamped from above
    and up to [-limit, limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """Routed experts: x [T, H], gate_up [E, 2I, H], down [E, H, I], ids/weights [T, k] ->
    sum over each token's k experts of weight * down(swiglu(gate, up, limit)), [T, H]. One GEMM
    pair per expert that received tokens."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        return F.linear(swiglu(gate, up, limit), down[e])

    return per_expert(x, topk_ids, topk_weights, gate_up.shape[0], expert)


def per_expert(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(e, its rows), [T, H]: the tokens of
    each expert that received any gathered and run as one batch. An id of -1 is a pick no
    expert here runs (another rank's, under expert parallelism): it adds nothing."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)  # the -1 picks first
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts).tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = flat.numel() - sum(counts)
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        start += n
        tokens = sel // k
        out.index_add_(0, tokens, expert(e, x[tokens]).float() * weights[sel, None])
    return out.to(x.dtype)


def sparse_sink_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """DeepSeek-V4's attention (FlashMLA's sparse contract with `attn_sink`): query t attends to
    kv[indices[t]] only, one K=V head shared by every query head, each head's softmax also
    over a learned sink logit that takes weight and gives nothing. q [T, H, D], kv [N, D],
    indices [T, K] (-1: no key), sinks [H] fp32 -> [T, H, D] in q's dtype."""
    t, heads, d = q.shape
    out = q.new_empty(t, heads, d)
    step = max(1, TILE_ELEMENTS // max(1, indices.shape[1] * max(d, heads)))
    for i in range(0, t, step):
        idx = indices[i : i + step].long()
        keys = kv.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, d).float()
        scores = torch.einsum("thd,tkd->thk", q[i : i + step].float(), keys) * scale
        scores = scores.masked_fill((idx < 0)[:, None, :], float("-inf"))
        sink = sinks.float()[None, :, None].expand(scores.shape[0], heads, 1)
        logits = torch.cat((scores, sink), dim=-1)
        probs = (logits - logits.max(dim=-1, keepdim=True).values).softmax(dim=-1)[..., :-1]
        out[i : i + step] = torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)
    return out

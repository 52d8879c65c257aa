"""DeepSeek-V3.2's lightning-indexer scores in one Triton kernel (torch_ref.indexer_logits's
contract): logits[t, l] = sum_h weights[t, h] * relu(scale * q[t, h] . k[l]).

Each program owns a tile of queries x keys and loops over the index heads, so the [T, heads, L]
products the torch reference materialises tile by tile never leave registers. q and k are read
in their own dtype (bf16 on the GPU: tensor cores), accumulated in fp32; the softmax scale rides
on the head weights (relu(s x) = s relu(x) for s > 0). DeepGEMM's fp8_mqa_logits is the FP8
version of the same computation; it does not load on this host.

``indexer_logits_rows`` scores every selecting row of a batch at once
(stages.kernels.indexer_select), keys read from the paged cache through each row's slot table,
-inf where a token does not see a key: one launch for the chunk rows (a program: up to 64
tokens of a row x a block of its keys, the arithmetic of ``indexer_logits``) and one for the
decode rows (a program: one token's index heads as the MMA's rows x a block of its keys).
Under an FP8 cache the keys are e4m3 with a float32 scale each, in stages/kernels/fp8_indexer.py's
block layout (a block's values, 16-byte aligned, then its scales), and the queries are quantized
to e4m3 per head (``quantize_queries``: one kernel, fp8_indexer's rule, its scales folded into
the head weights): both kernels' MMAs run on FP8 tensor cores, and each key's column of scores
is multiplied by its scale once, after the ReLU and the head sum (a positive power of two:
relu(s x) = s relu(x), and scaling by it is exact). On the H200 (docs/PERFORMANCE.md, session
14): 8192 queries x 64K keys 10.5 ms over FP8 keys against 17.5 over bf16; 512 decode rows x 64K
keys 3.0 against 3.8 ms.

Index heads of another width than 64 or 128 (and, for decode rows, fewer than 16 or not a power
of two) are refused when the stage is built (``supports``); a call that gets them anyway, or
keys in another dtype, goes to the torch reference, counted and logged once
(stages/kernels/fallbacks.py). Imports cleanly without triton or CUDA: triton is imported lazily.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from stages.kernels import pdl, triton_fp8_latent, triton_paged_decode
from stages.kernels.fallbacks import KernelTarget, Refusal, record_fallback

BLOCK_T, BLOCK_L = 64, 128
HEAD_DIMS = (64, 128)  # index head widths the kernels take


def is_available(device: str) -> bool:
    return triton_paged_decode.is_available(device)


def _heads_refused(heads: int) -> Refusal | None:
    """The decode kernel's MMA rows are the index heads: at least 16, a power of two."""
    if heads >= 16 and not heads & (heads - 1):
        return None
    return Refusal("heads", f"{heads} index heads (decode rows take a power of two >= 16)")


def supports(op: str, target: KernelTarget) -> Refusal | None:
    """Whether the kernels serve the model's indexer (None: they do)."""
    shape = target.shapes.get(op)
    if shape is None:  # the model has no indexer
        return None
    if shape.head_dim not in HEAD_DIMS:
        return Refusal("head_dim", f"index heads {shape.head_dim} wide; the kernels take 64, 128")
    return _heads_refused(shape.heads) if op == "indexer_logits_rows" else None


def _fall_back(op: str, refusal: Refusal) -> None:
    record_fallback(op, "triton", refusal.reason, f"{refusal.detail} -> torch reference")


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:  # a Triton JITFunction (untyped)
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def logits_kernel(Q, K, W, OUT, T, L, stride_qt, stride_qh, stride_kl, stride_wt,  # type: ignore[no-untyped-def]
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
            w = tl.load(W + offs_t * stride_wt + h, mask=t_mask, other=0.0)
            acc += tl.maximum(tl.dot(q, k), 0.0) * w[:, None]
        tl.store(OUT + offs_t[:, None] * stride_ot + offs_l[None, :], acc,
                 mask=t_mask[:, None] & l_mask[None, :])
    # fmt: on

    return logits_kernel


# 512 decode rows x 64K keys (session 14, call 3): 128 keys a program, FP8 3.04 ms and bf16
# 3.78, against 8.84 and 4.82 at 64
DECODE_BLOCK_L = 128


@dataclass(frozen=True)
class ChunkConfig:
    """The chunk kernel's launch: keys a program scores (BL), warps, pipeline stages and the
    registers a thread may take (None: what ptxas picks; fewer let more programs share an SM,
    one's ReLU and head sum filling another's MMA waits)."""

    block_l: int = BLOCK_L
    warps: int = 4
    stages: int = 3
    maxnreg: int | None = None


# the session-14 sweeps on the H200 (docs/bench/session14/call2-3, 8192 queries x 64K keys):
# no other launch beat this one over both key dtypes (FP8 10.5 ms, bf16 17.5). ptxas gives it
# 239 registers a thread: two programs an SM. Over FP8 keys 168 (92 bytes spilled) let three
# share an SM, one's ReLU and head sum running in another's MMA waits: 9.60 against 10.79 ms on
# an H100 for the 256K last chunk's 8K queries x 64K keys, the same bits (`python -m
# app.bench.indexer_select --chunk-launches`, session 24). bf16 keys keep ptxas's choice: their
# 80 KB of shared memory a program hold two programs an SM either way
CHUNK_CONFIG = ChunkConfig()
CHUNK_CONFIG_FP8 = ChunkConfig(maxnreg=168)


@dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's launch: keys a program scores, warps."""

    block_l: int = DECODE_BLOCK_L
    warps: int = 4


DECODE_CONFIG = DecodeConfig()
QUANTIZE_TOKENS = 4  # tokens a program of the query quantizer takes


@functools.lru_cache(maxsize=None)
def _rows_kernels() -> tuple[Any, Any]:  # Triton JITFunctions (untyped)
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def chunk_kernel(Q, K, KS, W, SLOTS, VISIBLE, TILES, OUT, M, LMAX, ENTRIES, stride_qt,  # type: ignore[no-untyped-def]
                     stride_qh, stride_kb, stride_sb, stride_wt, stride_sr, stride_ot, stride_m,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BT: tl.constexpr,
                     BL: tl.constexpr, KEY_FP8: tl.constexpr, GROUP: tl.constexpr,
                     PDL: tl.constexpr = False):
        """Up to BT tokens of one row x BL of its keys: logits_kernel's arithmetic (KEY_FP8:
        Q and K e4m3, KS each key's float32 scale). Slot s is entry s % ENTRIES of block
        s // ENTRIES (fp8_indexer's pages; bf16 keys are one entry's values after another).
        GROUP (> 0): M also gets each GROUP columns' maximum."""
        pdl.enter(PDL)
        tile = tl.program_id(0)
        row = tl.load(TILES + tile * 3).to(tl.int64)
        first = tl.load(TILES + tile * 3 + 1)
        count = tl.load(TILES + tile * 3 + 2)
        rel = tl.arange(0, BT)
        t_mask = rel < count
        offs_t = (first + rel).to(tl.int64)
        visible = tl.load(VISIBLE + offs_t, mask=t_mask, other=0)
        offs_l = tl.program_id(1) * BL + tl.arange(0, BL)
        out_ptrs = OUT + offs_t[:, None] * stride_ot + offs_l[None, :]
        store_mask = t_mask[:, None] & (offs_l[None, :] < LMAX)
        seen = tl.max(visible, 0)
        if tl.program_id(1) * BL >= seen:  # no token of the tile sees this block
            acc = tl.full((BT, BL), float("-inf"), tl.float32)
        else:
            l_mask = offs_l < seen
            slots = tl.load(SLOTS + row * stride_sr + offs_l, mask=l_mask, other=0).to(tl.int64)
            block = slots // ENTRIES
            entry = slots - block * ENTRIES
            offs_d = tl.arange(0, HEAD_DIM)
            key_rows = block * stride_kb + entry * HEAD_DIM
            k = tl.load(K + key_rows[None, :] + offs_d[:, None],
                        mask=l_mask[None, :], other=0.0)  # [D, BL]
            acc = tl.zeros([BT, BL], tl.float32)
            for h in range(HEADS):
                q = tl.load(Q + offs_t[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                            mask=t_mask[:, None], other=0.0)  # [BT, D]
                w = tl.load(W + offs_t * stride_wt + h, mask=t_mask, other=0.0)
                acc += tl.maximum(tl.dot(q, k), 0.0) * w[:, None]
            if KEY_FP8:  # a positive power of two: relu and the head sum commute with it
                acc = acc * tl.load(KS + block * stride_sb + entry, mask=l_mask, other=0.0)[None, :]
            acc = tl.where(offs_l[None, :] < visible[:, None], acc, float("-inf"))
        tl.store(out_ptrs, acc, mask=store_mask)
        if GROUP:
            groups = tl.program_id(1) * (BL // GROUP) + tl.arange(0, BL // GROUP)
            tl.store(M + offs_t[:, None] * stride_m + groups[None, :],
                     tl.max(tl.reshape(acc, (BT, BL // GROUP, GROUP)), 2),
                     mask=t_mask[:, None] & (groups[None, :] * GROUP < LMAX))
    # fmt: on

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def decode_kernel(Q, K, KS, W, SLOTS, VISIBLE, TILES, OUT, M, LMAX, ENTRIES, stride_qt,  # type: ignore[no-untyped-def]
                      stride_qh, stride_kb, stride_sb, stride_wt, stride_sr, stride_ot, stride_m,
                      HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BL: tl.constexpr,
                      KEY_FP8: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr = False):
        """One token (a decode row) x BL of its keys; the index heads are the MMA's rows.
        GROUP as chunk_kernel's."""
        pdl.enter(PDL)
        tile = tl.program_id(0)
        row = tl.load(TILES + tile * 2).to(tl.int64)
        tok = tl.load(TILES + tile * 2 + 1).to(tl.int64)
        visible = tl.load(VISIBLE + tok)
        offs_l = tl.program_id(1) * BL + tl.arange(0, BL)
        out_ptrs = OUT + tok * stride_ot + offs_l
        if tl.program_id(1) * BL >= visible:
            logit = tl.full((BL,), float("-inf"), tl.float32)
        else:
            l_mask = offs_l < visible
            slots = tl.load(SLOTS + row * stride_sr + offs_l, mask=l_mask, other=0).to(tl.int64)
            block = slots // ENTRIES
            entry = slots - block * ENTRIES
            offs_d = tl.arange(0, HEAD_DIM)
            key_rows = block * stride_kb + entry * HEAD_DIM
            k = tl.load(K + key_rows[None, :] + offs_d[:, None],
                        mask=l_mask[None, :], other=0.0)  # [D, BL]
            hs = tl.arange(0, HEADS)
            q = tl.load(Q + tok * stride_qt + hs[:, None] * stride_qh + offs_d[None, :])
            s = tl.maximum(tl.dot(q, k), 0.0)  # [HEADS, BL]
            w = tl.load(W + tok * stride_wt + hs)
            logit = tl.sum(s * w[:, None], 0)
            if KEY_FP8:  # as in chunk_kernel: each key's scale after the head sum
                logit = logit * tl.load(KS + block * stride_sb + entry, mask=l_mask, other=0.0)
            logit = tl.where(l_mask, logit, float("-inf"))
        tl.store(out_ptrs, logit, mask=offs_l < LMAX)
        if GROUP:
            groups = tl.program_id(1) * (BL // GROUP) + tl.arange(0, BL // GROUP)
            tl.store(M + tok * stride_m + groups,
                     tl.max(tl.reshape(logit, (BL // GROUP, GROUP)), 1),
                     mask=groups * GROUP < LMAX)
    # fmt: on

    return chunk_kernel, decode_kernel


@functools.lru_cache(maxsize=None)
def _quantize_kernel() -> Any:  # a Triton JITFunction (untyped)
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def quantize_kernel(Q, W, QOUT, WOUT, T, scale, stride_qt, stride_qh, stride_wt,  # type: ignore[no-untyped-def]
                        HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
                        FP8_MAX: tl.constexpr, PDL: tl.constexpr = False):
        """fp8_indexer.quantize_queries of TOKENS tokens (each head its power-of-two scale,
        the same bits), and their head weights times the softmax scale and that scale."""
        pdl.enter(PDL)
        offs_d = tl.arange(0, HEAD_DIM)
        hs = tl.arange(0, HEADS)
        for i in tl.static_range(TOKENS):
            t = tl.program_id(0) * TOKENS + i
            if t < T:
                x = tl.load(Q + t * stride_qt + hs[:, None] * stride_qh
                            + offs_d[None, :]).to(tl.float32)  # [HEADS, D]
                # the keys' rule, the same bits: [HEADS], a scale a head
                q_scale, _exponent = triton_fp8_latent._pow2_scale(x, FP8_MAX, 1)
                tl.store(QOUT + t * HEADS * HEAD_DIM + hs[:, None] * HEAD_DIM + offs_d[None, :],
                         (x / q_scale[:, None]).to(tl.float8e4nv))
                w = tl.load(W + t * stride_wt + hs).to(tl.float32)
                tl.store(WOUT + t * HEADS + hs, w * scale * q_scale)
    # fmt: on

    return quantize_kernel


def quantize_queries(
    q: torch.Tensor, weights: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [T, H, D], float32 [T, H]): fp8_indexer.quantize_queries's values, and the head
    weights times the softmax scale and each head's scale (what the FP8 scores weigh each
    head's relu by): one kernel on CUDA, where torch took about ten."""
    from stages.kernels import fp8_latent

    ts, heads, dim = q.shape
    values = torch.empty(ts, heads, dim, dtype=torch.float8_e4m3fn, device=q.device)
    scaled = torch.empty(ts, heads, dtype=torch.float32, device=q.device)
    if ts:
        q = q if q.stride(-1) == 1 else q.contiguous()
        weights = weights if weights.stride(-1) == 1 else weights.contiguous()
        _quantize_kernel()[(-(-ts // QUANTIZE_TOKENS),)](
            q, weights, values, scaled, ts, scale, q.stride(0), q.stride(1), weights.stride(0),
            HEADS=heads, HEAD_DIM=dim, TOKENS=QUANTIZE_TOKENS, FP8_MAX=fp8_latent.FP8_MAX,
            **pdl.options(values),
        )  # fmt: skip
    return values, scaled


def _key_views(keys: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(values, scales, entries per block, the values' and scales' block strides) of the key
    pages: FP8 pages split in place (fp8_indexer.split); bf16 keys as one block of entries
    (their scales unread: the kernel's FP8 branch is compiled out)."""
    from stages.kernels import fp8_indexer

    if keys.dtype == torch.uint8:
        values, scales = fp8_indexer.split(keys)
        return values, scales, values.shape[1], values.stride(0), scales.stride(0)
    flat = keys.reshape(-1, dim).contiguous()  # the kernels step D values from key to key
    return flat, flat, flat.shape[0], 0, 0


def indexer_logits_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    plan: Any,
    config: ChunkConfig | None = None,
    decode: DecodeConfig = DECODE_CONFIG,
    maxima: torch.Tensor | None = None,
) -> torch.Tensor:
    """indexer_select.logits_rows_reference's contract: q [Ts, Hi, D], keys the layer's key
    pages ([blocks, E, D] in q's dtype, or [blocks, E, D + 4] uint8: FP8 keys in
    stages/kernels/fp8_indexer.py's layout), weights [Ts, Hi], plan -> [Ts, Lmax] fp32 (-inf
    where a token does not see a key); maxima (indexer_select.maxima_buffer) filled with each
    group's maximum by the same launches, which spares the top-k a pass over the scores.
    Chunk rows and decode rows are one launch each. config / decode: the kernels' launches
    (benches sweep them; config by default CHUNK_CONFIG_FP8 over FP8 keys, else
    CHUNK_CONFIG)."""
    from stages.kernels import fp8_indexer_layout, indexer_select

    ts, heads, dim = q.shape
    lmax = plan.key_slots.shape[1]
    fp8 = keys.dtype == torch.uint8
    if fp8:
        readable = q.is_floating_point() and keys.shape[-1] == dim + fp8_indexer_layout.SCALE_BYTES
    else:
        readable = keys.dtype == q.dtype and keys.shape[-1] == dim
    if dim not in HEAD_DIMS:
        refusal: Refusal | None = Refusal("head_dim", f"index heads {dim} wide")
    elif not readable:
        refusal = Refusal("dtype", f"queries in {q.dtype}, keys {tuple(keys.shape)} {keys.dtype}")
    else:  # decode tiles' MMA rows are the heads
        refusal = _heads_refused(heads) if plan.decode_tiles.shape[0] else None
    if refusal is not None:
        _fall_back("indexer_logits_rows", refusal)
        return indexer_select.logits_rows_reference(q, keys, weights, scale, plan, maxima)
    if fp8:  # FP8 queries against the keys' e4m3 values; each key's scale after them
        q, weights = quantize_queries(q, weights, scale)
    else:  # relu(s x) = s relu(x) for s > 0: the softmax scale rides on the head weights
        weights = weights.float() * scale
    config = config or (CHUNK_CONFIG_FP8 if fp8 else CHUNK_CONFIG)
    values, scales, entries, stride_kb, stride_sb = _key_views(keys, dim)
    q, weights = q.contiguous(), weights.contiguous()
    out = torch.empty(ts, lmax, dtype=torch.float32, device=q.device)
    group = indexer_select.MAXIMA_GROUP if maxima is not None else 0
    if maxima is None:
        maxima = out  # not written: GROUP 0 compiles the maxima out
    elif maxima.shape != indexer_select.maxima_shape(ts, lmax) or maxima.stride(1) != 1:
        raise ValueError(f"maxima {tuple(maxima.shape)} for {ts} lines of {lmax} scores")
    chunk_kernel, decode_kernel = _rows_kernels()
    args = (q, values, scales, weights, plan.key_slots, plan.visible)
    strides = (
        q.stride(0),
        q.stride(1),
        stride_kb,
        stride_sb,
        weights.stride(0),
        plan.key_slots.stride(0),
        out.stride(0),
        maxima.stride(0),
    )
    if plan.chunk_tiles.shape[0]:
        grid = (plan.chunk_tiles.shape[0], -(-lmax // config.block_l))
        chunk_kernel[grid](
            *args,
            plan.chunk_tiles,
            out,
            maxima,
            lmax,
            entries,
            *strides,
            HEADS=heads,
            HEAD_DIM=dim,
            BT=indexer_select.CHUNK_TILE,
            BL=config.block_l,
            KEY_FP8=fp8,
            GROUP=group,
            num_warps=config.warps,
            num_stages=config.stages,
            maxnreg=config.maxnreg,
            **pdl.options(out),
        )
    if plan.decode_tiles.shape[0]:
        grid = (plan.decode_tiles.shape[0], -(-lmax // decode.block_l))
        decode_kernel[grid](
            *args,
            plan.decode_tiles,
            out,
            maxima,
            lmax,
            entries,
            *strides,
            HEADS=heads,
            HEAD_DIM=dim,
            BL=decode.block_l,
            KEY_FP8=fp8,
            GROUP=group,
            num_warps=decode.warps,
            **pdl.options(out),
        )
    return out


def indexer_logits(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, Hi, D], k [L, D], weights [T, Hi] fp32 -> [T, L] fp32 (no causal mask)."""
    t, heads, dim = q.shape
    length = k.shape[0]
    if dim not in HEAD_DIMS or k.dtype != q.dtype:
        from stages.kernels import torch_ref

        reason = "head_dim" if dim not in HEAD_DIMS else "dtype"
        _fall_back("indexer_logits", Refusal(reason, f"{dim} wide, {q.dtype} / {k.dtype}"))
        return torch_ref.indexer_logits(q, k, weights, scale)
    q, k = q.contiguous(), k.contiguous()
    weights = (weights.float() * scale).contiguous()  # as indexer_logits_rows: scale on weights
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    grid = (-(-t // BLOCK_T), -(-length // BLOCK_L))
    _kernel()[grid](
        q,
        k,
        weights,
        out,
        t,
        length,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        weights.stride(0),
        out.stride(0),
        HEADS=heads,
        HEAD_DIM=dim,
        BT=BLOCK_T,
        BL=BLOCK_L,
    )
    return out

"""DeepSeek-V4's hyper-connections on CUDA in three Triton kernels (the contract of
stages.kernels.hyper_connection): the torch form is a 4-wide batched GEMM that cuBLAS runs on
tiny misaligned tiles, an fp32 copy of every stream for the norm and the projection, and some
hundred small kernels for the Sinkhorn iterations per call, so it is bound by launches in decode
and by memory traffic in prefill.

- ``_project``: per block of tokens and slice of the streams, the projection's partial sums and
  the sum of squares (the RMS norm's factor is applied after: F.linear(x * r, fn) =
  r * F.linear(x, fn)). The products run on bf16 tensor cores at fp32 accuracy: the streams are
  bf16, and the fp32 weights go in as three bf16 pieces (w = w1 + w2 + w3, 24 mantissa bits).
  Short batches split the streams' width over more programs (decode rows are few).
- ``_finish``: per token (per block of tokens where a row is wider than a tile), the partial
  sums added in a fixed order, then the sigmoids, the softmax and the Sinkhorn iterations in
  registers, and the collapse of the streams by `pre` over the hidden size; given the block's
  input norm (``out_norm``), V4RMSNorm of the collapse too, where it was another kernel.
- ``_merge``: post * out + comb^T @ streams per (tokens, hidden) tile, rounded as the torch
  form rounds (each product to the streams' dtype, then their sum).

hc_mult must be a power of two (V4's is 4); other widths, other devices and streams not in bf16
take the torch form, counted and logged once (stages/kernels/fallbacks.py), as do empty batches
(not counted: no work either way).
"""

from __future__ import annotations

import torch

from stages.kernels import hyper_connection, pdl
from stages.kernels.fallbacks import record_fallback

BLOCK_T, BLOCK_K, BLOCK_D = 16, 128, 256
# how _project multiplies the bf16 streams by the fp32 weights at fp32 accuracy: "ieee" (fp32
# FMAs) or "bf16x3" (three bf16 tensor-core products, the weights split in three: as accurate,
# and faster, docs/PERFORMANCE.md); both are tested against the torch form
PRECISIONS = ("ieee", "bf16x3")
PRECISION = "bf16x3"
TARGET_PROGRAMS = 264  # two per SM of an H200: enough to fill the chip with short batches
# a one-row step's projection: 64 programs of two weight slices each, not 16 of eight
MAX_SPLIT = 64
ROW_ELEMENTS = 16384  # the widest [streams, hidden] row _finish holds in one tile


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None


def _fits(op: str, streams: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether the kernels take these streams (and block output); if not, the fallback is
    recorded (an empty batch is not: no work on either path)."""
    n = streams.shape[1]
    if streams.shape[0] == 0:
        return False
    if triton is None:
        reason = "no_triton"
    elif not streams.is_cuda:
        reason = "device"
    elif streams.dtype != torch.bfloat16 or (out is not None and out.dtype != streams.dtype):
        reason = "dtype"
    elif n & (n - 1):
        reason = "shape"
    else:
        return True
    detail = f"{n} streams in {streams.dtype} on {streams.device} -> torch form"
    record_fallback(op, "triton", reason, detail)
    return False


def mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    out_norm: tuple[torch.Tensor, float] | None = None,
    precision: str = PRECISION,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
    if not _fits("hc_mix", streams):
        return hyper_connection.mix(streams, fn, base, scale, iters, eps, norm_eps, out_norm)
    return launch_mix(streams, fn, base, scale, iters, eps, norm_eps, out_norm, precision)


def launch_mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    out_norm: tuple[torch.Tensor, float] | None = None,
    precision: str = PRECISION,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' launches on any device Triton runs on (its interpreter's tests call it)."""
    t, n, d = streams.shape
    m = (2 + n) * n
    x = streams.contiguous()
    w = fn.float().contiguous()
    k = n * d
    block_t, warps = project_tile(t)
    blocks = triton.cdiv(t, block_t)
    split = max(1, min(MAX_SPLIT, TARGET_PROGRAMS // blocks, triton.cdiv(k, BLOCK_K)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    split = triton.cdiv(k, k_per_split)
    parts = torch.empty(split, t, m, dtype=torch.float32, device=x.device)
    squares = torch.empty(split, t, dtype=torch.float32, device=x.device)
    _project[(blocks, split)](
        x, w, parts, squares, t, k, m, k_per_split,
        BLOCK_T=block_t, BLOCK_K=BLOCK_K, BLOCK_M=triton.next_power_of_2(max(m, 16)),
        PRECISION=precision, num_warps=warps, **pdl.options(x),
    )  # fmt: skip
    block_t, block_d, finish_warps = finish_tile(t, n, d)
    post = torch.empty(t, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    collapsed = torch.empty(t, d, dtype=x.dtype, device=x.device)
    weight, out_eps = (base, 0.0) if out_norm is None else out_norm
    _finish[(triton.cdiv(t, block_t),)](
        parts, squares, base.float().contiguous(), scale.float().contiguous(), x, post, comb,
        collapsed, weight.float().contiguous(), t, d, split, iters, eps, norm_eps, 1.0 / d,
        out_eps, N=n, NORM=out_norm is not None, CUDA_RSQRT=x.is_cuda, BLOCK_T=block_t,
        BLOCK_D=block_d, SPLIT_BLOCK=min(triton.next_power_of_2(split), 64 // block_t),
        num_warps=finish_warps, **pdl.options(x),
    )  # fmt: skip
    return post, comb, collapsed


def project_tile(tokens: int) -> tuple[int, int]:
    """(_project's tokens per program, warps): a tall tile for long batches, where sixteen-token
    programs each re-read and re-split the whole fp32 weight (V4-Flash's 8K chunk: 0.57 ms a
    call at 16, 0.11 at 128, docs/bench/session13/call2/sweep.jsonl); decode rows keep 16."""
    if tokens >= 4096:
        return 128, 8
    if tokens >= 256:
        return 64, 4
    return BLOCK_T, 4


def finish_tile(tokens: int, n: int, d: int) -> tuple[int, int, int]:
    """(_finish's tokens per program, hidden slice a step, warps): a token's whole row of
    streams in one tile where it fits (V4-Flash's 4 x 4096), one program a token, so a short
    batch does not walk the row in sixteen steps twice in one program (a one-row decode step's
    16 calls took 0.44 ms in sixteen-token programs, docs/bench/session16/call1); wider rows
    in sixteen-token tiles a slice at a time."""
    whole = triton.next_power_of_2(d)
    if n * whole <= ROW_ELEMENTS:
        return 1, whole, max(4, min(16, n * whole // 1024))
    return BLOCK_T, BLOCK_D, 4


def merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    if not _fits("hc_merge", streams, out):
        return hyper_connection.merge(streams, out, post, comb)
    t, n, d = streams.shape
    x, o = streams.contiguous(), out.contiguous()
    result = torch.empty_like(x)
    grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(d, BLOCK_D))
    _merge[grid](
        x, o, post.float().contiguous(), comb.float().contiguous(), result, t, d,
        N=n, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4, **pdl.options(x),
    )  # fmt: skip
    return result


try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter

    @triton.jit  # type: ignore[untyped-decorator]
    def _project(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, part_ptr, sq_ptr, T, K, M, K_PER_SPLIT,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """part[s, t, :M] = x[t, ks] @ w[:, ks].T and sq[s, t] = sum(x[t, ks]^2) over split s's
        slice ks of K; x [T, K] bf16, w [M, K] fp32."""
        enter(PDL)
        split = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_M)
        row_ok, col_ok = rows < T, cols < M
        acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
        squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
        k_start = split * K_PER_SPLIT
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # the last split's tail is masked
            ks = k_start + k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(
                w_ptr + cols[None, :] * K + ks[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            squares += tl.sum(x * x, axis=1)
            if PRECISION == "bf16x3":  # three bf16 pieces hold fp32's 24 mantissa bits
                xb = x.to(tl.bfloat16)
                for _ in tl.static_range(3):
                    piece = w.to(tl.bfloat16, fp_downcast_rounding="rtne")
                    acc = tl.dot(xb, piece, acc)
                    w = w - piece.to(tl.float32)
            else:
                acc = tl.dot(x, w, acc, input_precision="ieee")
        tl.store(
            part_ptr + (split * T + rows[:, None]) * M + cols[None, :],
            acc,
            mask=row_ok[:, None] & col_ok[None, :],
        )
        tl.store(sq_ptr + split * T + rows, squares, mask=row_ok)

    @triton.jit  # type: ignore[untyped-decorator]
    def _finish(  # type: ignore[no-untyped-def]
        part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, w_ptr, T, D,
        SPLIT, iters, eps, norm_eps, inv_d, out_eps, N: tl.constexpr, NORM: tl.constexpr,
        CUDA_RSQRT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        SPLIT_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """Each token's mix row [pre N | post N | comb N x N] from the partial sums and the RMS
        factor; pre, post and the Sinkhorn-normalised comb; out[t] = sum_i pre[t, i] * x[t, i]
        (NORM: then V4RMSNorm's (out * rsqrt(mean(out^2) + out_eps)) * w in fp32, cast once,
        as rms_norm_fp32's kernel, over the rounded out)."""
        enter(PDL)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        i = tl.arange(0, N)
        ij = i[:, None] * N + i[None, :]  # [N, N]: comb[i, j]
        pre_w = tl.zeros((BLOCK_T, N), dtype=tl.float32)
        post_w = tl.zeros((BLOCK_T, N), dtype=tl.float32)
        comb_w = tl.zeros((BLOCK_T, N * N), dtype=tl.float32)
        squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
        ss = tl.arange(0, SPLIT_BLOCK)
        for s0 in range(0, SPLIT, SPLIT_BLOCK):  # SPLIT_BLOCK splits' partial sums a load
            s = s0 + ss
            ok = (s < SPLIT)[:, None] & row_ok[None, :]  # [S, T]
            mix_row = part_ptr + (s[:, None] * T + rows[None, :]) * ((2 + N) * N)
            pre_w += tl.sum(tl.load(mix_row[:, :, None] + i, mask=ok[:, :, None], other=0.0), 0)
            post_w += tl.sum(
                tl.load(mix_row[:, :, None] + N + i, mask=ok[:, :, None], other=0.0), 0
            )
            comb_w += tl.sum(
                tl.load(mix_row[:, :, None] + 2 * N + tl.arange(0, N * N), mask=ok[:, :, None],
                        other=0.0),
                0,
            )  # fmt: skip
            square_parts = sq_ptr + s[:, None] * T + rows[None, :]
            squares += tl.sum(tl.load(square_parts, mask=ok, other=0.0), 0)
        factor = tl.rsqrt(squares / (N * D) + norm_eps)
        s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
        pre_w = pre_w * factor[:, None]
        pre = tl.sigmoid(pre_w * s_pre + tl.load(base_ptr + i)[None, :]) + eps
        post_w = post_w * factor[:, None]
        post = 2 * tl.sigmoid(post_w * s_post + tl.load(base_ptr + N + i)[None, :])
        comb_w = tl.reshape(comb_w, (BLOCK_T, N, N)) * factor[:, None, None]
        logits = comb_w * s_comb + tl.load(base_ptr + 2 * N + ij)[None, :, :]
        logits = logits - tl.max(logits, axis=2)[:, :, None]
        e = tl.exp(logits)
        comb = e / tl.sum(e, axis=2)[:, :, None] + eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        tl.store(post_ptr + rows[:, None] * N + i[None, :], post, mask=row_ok[:, None])
        tl.store(
            comb_ptr + rows[:, None, None] * (N * N) + ij[None, :, :], comb,
            mask=row_ok[:, None, None],
        )  # fmt: skip
        if BLOCK_D >= D:  # the whole row in one tile: its norm from registers
            ds = tl.arange(0, BLOCK_D)
            ok = row_ok[:, None] & (ds < D)[None, :]
            x = tl.load(
                x_ptr + rows[:, None, None].to(tl.int64) * (N * D) + i[None, :, None] * D
                + ds[None, None, :],
                mask=ok[:, None, :], other=0.0,
            ).to(tl.float32)  # fmt: skip
            collapsed = tl.sum(pre[:, :, None] * x, axis=1).to(out_ptr.dtype.element_ty)
            if NORM:
                h = collapsed.to(tl.float32)
                factor = _rsqrt(tl.sum(h * h, axis=1) * inv_d + out_eps, CUDA_RSQRT)
                w = tl.load(w_ptr + ds, mask=ds < D, other=0.0)[None, :]
                collapsed = (h * factor[:, None] * w).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * D + ds[None, :], collapsed, mask=ok)
        else:
            _collapse_by_slices(
                x_ptr, out_ptr, w_ptr, pre, rows, row_ok, i, D, inv_d, out_eps, N, NORM,
                CUDA_RSQRT, BLOCK_T, BLOCK_D,
            )  # fmt: skip

    @triton.jit  # type: ignore[untyped-decorator]
    def _rsqrt(x, CUDA_RSQRT: tl.constexpr):  # type: ignore[no-untyped-def]
        if CUDA_RSQRT:  # rsqrtf, as torch's rms_norm on CUDA
            return libdevice.rsqrt(x)
        return 1.0 / tl.sqrt(x)  # Triton's interpreter

    @triton.jit  # type: ignore[untyped-decorator]
    def _collapse_by_slices(  # type: ignore[no-untyped-def]
        x_ptr, out_ptr, w_ptr, pre, rows, row_ok, i, D, inv_d, out_eps, N: tl.constexpr,
        NORM: tl.constexpr, CUDA_RSQRT: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """_finish's collapse of rows wider than a tile, BLOCK_D at a time (NORM: the rows
        written, then read back and normed)."""
        out_sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            ok = row_ok[:, None, None] & (ds < D)[None, None, :]
            x = tl.load(
                x_ptr + rows[:, None, None].to(tl.int64) * (N * D) + i[None, :, None] * D
                + ds[None, None, :],
                mask=ok, other=0.0,
            ).to(tl.float32)  # fmt: skip
            collapsed = tl.sum(pre[:, :, None] * x, axis=1).to(out_ptr.dtype.element_ty)
            out_rows = out_ptr + rows[:, None].to(tl.int64) * D + ds[None, :]
            tl.store(out_rows, collapsed, mask=row_ok[:, None] & (ds < D)[None, :])
            if NORM:
                h = collapsed.to(tl.float32)
                out_sq += tl.sum(h * h, axis=1)
        if NORM:
            tl.debug_barrier()  # every write of the rows before they are read back
            factor = _rsqrt(out_sq * inv_d + out_eps, CUDA_RSQRT)
            for d0 in range(0, D, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                ok = row_ok[:, None] & (ds < D)[None, :]
                out_rows = out_ptr + rows[:, None].to(tl.int64) * D + ds[None, :]
                h = tl.load(out_rows, mask=ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + ds, mask=ds < D, other=0.0)[None, :]
                tl.store(out_rows, (h * factor[:, None] * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit  # type: ignore[untyped-decorator]
    def _merge(  # type: ignore[no-untyped-def]
        x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, T, D,
        N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """y[t, j] = round(post[t, j] * o[t]) + round(sum_i comb[t, i, j] * x[t, i]), with post
        and comb first rounded to the streams' dtype, as the torch form computes it."""
        enter(PDL)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        row_ok, d_ok = rows < T, ds < D
        j = tl.arange(0, N)
        dt = y_ptr.dtype.element_ty
        out_base = y_ptr + rows[:, None, None].to(tl.int64) * (N * D) + ds[None, None, :]
        acc = tl.zeros((BLOCK_T, N, BLOCK_D), dtype=tl.float32)
        for src in tl.static_range(N):
            x_i = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * (N * D) + src * D + ds[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0,
            ).to(tl.float32)  # fmt: skip
            c_i = tl.load(comb_ptr + rows[:, None] * (N * N) + src * N + j[None, :],
                          mask=row_ok[:, None], other=0.0)  # fmt: skip
            acc += (
                c_i.to(dt, fp_downcast_rounding="rtne").to(tl.float32)[:, :, None] * x_i[:, None, :]
            )
        post = tl.load(post_ptr + rows[:, None] * N + j[None, :], mask=row_ok[:, None], other=0.0)
        o = tl.load(
            o_ptr + rows[:, None].to(tl.int64) * D + ds[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        spread = (
            post.to(dt, fp_downcast_rounding="rtne").to(tl.float32)[:, :, None] * o[:, None, :]
        ).to(dt, fp_downcast_rounding="rtne")
        y = spread.to(tl.float32) + acc.to(dt, fp_downcast_rounding="rtne").to(tl.float32)
        tl.store(
            out_base + j[None, :, None] * D, y.to(dt, fp_downcast_rounding="rtne"),
            mask=row_ok[:, None, None] & d_ok[None, None, :],
        )  # fmt: skip

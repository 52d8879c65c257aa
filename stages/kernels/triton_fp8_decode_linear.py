"""W8A8 block-scaled linears of a decode step's few rows on the tensor cores, the weight's rows as
the MMA's wide side ("swap AB"): fp8_ref.linear's contract.

cuBLASLt's block-scaled GEMM tiles 128 x 128 whatever the row count: a one-row V4-Flash step's
27 FP8 linears stream their ~0.6 GB of weights at about 1.7 TB/s (0.37 ms of the H200's 2.2 ms
step, session 29), each after a quantizer launch. Here a program takes BLOCK_W weight rows
(one 128 x 128 scale block's half) along all of K, STAGES K steps in flight, and the batch's
rows (at most DECODE_ROWS, padded to BLOCK_X of 16 or 32, the MMA's narrow side); the 1 x 128
activation quantizer runs inside it (triton_fp8_act's arithmetic, to the bit), so a linear is
one launch.

The arithmetic is that of the Triton block-scaled GEMMs (triton_gemm.dot_rows, whose grouped
form equals DeepGEMM's bits): each 128-wide K step's fp32 product on the tensor cores, times
(activation scale x weight scale), added to the sum in K order; no split of K. So a row's
bits do not depend on how many rows share the call (session 19's CUDA-core GEMV summed in
another order and parted batched requests from their lone runs). Whether they equal cuBLASLt's
(what rows past DECODE_ROWS take) is measured on the device (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_ref, pdl, triton_fp8_act

DECODE_ROWS = 32  # rows a call takes; more go to the GEMMs
BLOCK_W = 64  # weight rows a program: the MMA's M (one warpgroup's wgmma)
STAGES = 6  # K steps in flight a program (8 KB of weights each)
WARPS = 4


def takes(rows: int, n: int, k: int) -> bool:
    return 1 <= rows <= DECODE_ROWS and k % fp8_ref.BLOCK == 0 and n >= 1


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (at most DECODE_ROWS rows), weight [N, K] e4m3, scale_inv [ceil(N/128), K/128]
    -> [..., N] in x's dtype."""
    return _launch(x, weight, scale_inv, bias, swiglu=False, limit=None)


def swiglu_linear(
    gate_up: torch.Tensor,
    limit: float | None,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear(torch_ref.swiglu(gate, up, limit), ...) of gate_up [..., 2K] (gate | up), the
    swiglu's steps (triton_fp8_act.swiglu_steps) before the quantizer, in the same kernel."""
    return _launch(gate_up, weight, scale_inv, bias, swiglu=True, limit=limit)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    swiglu: bool,
    limit: float | None,
    block_w: int = BLOCK_W,
    stages: int = STAGES,
) -> torch.Tensor:
    n, k = weight.shape
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if flat.shape[1] != (2 * k if swiglu else k) or not takes(m, n, k):
        raise ValueError(f"the FP8 decode linear takes 1 to {DECODE_ROWS} rows, K on the 128 grid")
    if fp8_ref.BLOCK % block_w:
        raise ValueError(f"BLOCK_W {block_w} must divide the scale block {fp8_ref.BLOCK}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    scales = scale_inv.float().contiguous()
    _swap_ab_w8a8[(triton.cdiv(n, block_w),)](
        flat, weight, scales, weight if bias is None else bias, out, m, n, k, flat.stride(0),
        weight.stride(0), scales.stride(0), out.stride(0),
        0.0 if limit is None else triton_fp8_act.rounded(limit, x.dtype),
        HAS_BIAS=bias is not None, SWIGLU=swiglu, HAS_LIMIT=limit is not None,
        CUDA_EXP=x.is_cuda, BLOCK_X=max(16, triton.next_power_of_2(m)), BLOCK_W=block_w,
        BLOCK_K=fp8_ref.BLOCK, INV_FP8_MAX=1 / fp8_ref.FP8_MAX, MIN_SCALE=fp8_ref.MIN_SCALE,
        STAGES=stages, num_warps=WARPS, **pdl.options(x),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter
    from stages.kernels.triton_fp8_act import swiglu_steps

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _swap_ab_w8a8(  # type: ignore[no-untyped-def]
        X, W, WS, BIAS, OUT, M, N, K, stride_xm, stride_wn, stride_wsn, stride_om, limit,
        HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
        CUDA_EXP: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_K: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """out[:, cols].T = W[cols] @ quantized(X).T, K step by K step. SWIGLU: X's rows are
        gate | up (2K wide), the swiglu's steps before the quantizer."""
        enter(PDL)
        cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
        col_ok = cols < N
        w_rows = W + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_wn
        # BLOCK_W divides the scale block: one weight scale a K step for the whole tile
        w_scales = WS + (tl.program_id(0) * BLOCK_W // BLOCK_K).to(tl.int64) * stride_wsn
        rows = tl.arange(0, BLOCK_X)
        row_ok = rows < M
        x_rows = X + rows.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_W, BLOCK_X), dtype=tl.float32)
        for ki in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + ks[None, :])  # [BLOCK_W, BLOCK_K] e4m3
            w_s = tl.load(w_scales + ki)
            if SWIGLU:
                gate = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
                up = tl.load(x_rows + K + ks[None, :], mask=row_ok[:, None], other=0.0)
                x = swiglu_steps(gate, up, limit, HAS_LIMIT, CUDA_EXP)
            else:
                x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            # triton_fp8_act's quantizer, to the bit (IEEE division, e4m3 round-to-nearest)
            a_s = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_SCALE) * INV_FP8_MAX
            a_q = tl.div_rn(x, tl.broadcast_to(a_s[:, None], x.shape)).to(tl.float8e4nv)
            # dot_rows's step, transposed: (activation scale x weight scale) times the product
            acc += tl.dot(w, tl.trans(a_q)) * (a_s[None, :] * w_s)
        out = acc.to(OUT.dtype.element_ty)
        if HAS_BIAS:  # added after the cast, as fp8_gemm adds it to cuBLASLt's output
            bias = tl.load(BIAS + cols, mask=col_ok, other=0.0)
            out = (out.to(tl.float32) + bias.to(tl.float32)[:, None]).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[None, :] * stride_om + cols[:, None], out,
                 mask=row_ok[None, :] & col_ok[:, None])
    # fmt: on

"""W8A8 block-scaled linears of a decode step's few rows on the tensor cores, the weight's rows as
the MMA's wide side ("swap AB"): fp8_ref.linear's contract.

cuBLASLt's block-scaled GEMM tiles 128 x 128 whatever the row count: a one-row V4-Flash step's
27 FP8 linears stream their ~0.6 GB of weights at about 1.7 TB/s (0.37 ms of the H200's 2.2 ms
step, session 29). Here a program takes BLOCK_W weight rows (one 128 x 128 scale block's half)
along all of K, STAGES K steps in flight, and the batch's rows (at most DECODE_ROWS, padded to
BLOCK_X of 16 or 32, the MMA's narrow side), quantized beforehand by triton_fp8_act (one launch,
as for cuBLASLt): quantizing them inside the K loop put each step's quantized tile through
shared memory before its MMA and took the one-row step from 2.35 to 4.6 ms on an H100.

The arithmetic is that of the Triton block-scaled GEMMs (triton_gemm.dot_rows, whose grouped
form equals DeepGEMM's bits) and, measured on an H100, of cuBLASLt's where it does not split K:
each 128-wide K step's fp32 product on the tensor cores, times (activation scale x weight
scale), added to the sum in K order; no split of K. So a row's bits do not depend on how many
rows share the call (session 19's CUDA-core GEMV summed in another order and parted batched
requests from their lone runs).
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
    swiglu folded into the quantizer (triton_fp8_act.swiglu_quantize_act)."""
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
    m = flat.shape[0]
    if flat.shape[1] != (2 * k if swiglu else k) or not takes(m, n, k):
        raise ValueError(f"the FP8 decode linear takes 1 to {DECODE_ROWS} rows, K on the 128 grid")
    if fp8_ref.BLOCK % block_w:
        raise ValueError(f"BLOCK_W {block_w} must divide the scale block {fp8_ref.BLOCK}")
    if swiglu:
        q, q_scale = triton_fp8_act.swiglu_quantize_act(flat, limit)
    else:
        q, q_scale = triton_fp8_act.quantize_act(flat)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    scales = scale_inv.float().contiguous()
    _swap_ab_w8a8[(triton.cdiv(n, block_w),)](
        q, q_scale, weight, scales, weight if bias is None else bias, out, m, n, k, q.stride(0),
        q_scale.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_X=max(16, triton.next_power_of_2(m)), BLOCK_W=block_w,
        BLOCK_K=fp8_ref.BLOCK, STAGES=stages, num_warps=WARPS, **pdl.options(x),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _swap_ab_w8a8(  # type: ignore[no-untyped-def]
        X, XS, W, WS, BIAS, OUT, M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn,
        stride_om, HAS_BIAS: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """out[:, cols].T = W[cols] @ X.T, K step by K step: X [M, K] e4m3 with its 1 x 128
        scales XS [M, K / 128]."""
        enter(PDL)
        cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
        col_ok = cols < N
        w_rows = W + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_wn
        # BLOCK_W divides the scale block: one weight scale a K step for the whole tile
        w_scales = WS + (tl.program_id(0) * BLOCK_W // BLOCK_K).to(tl.int64) * stride_wsn
        rows = tl.arange(0, BLOCK_X)
        row_ok = rows < M
        x_rows = X + rows.to(tl.int64)[:, None] * stride_xm
        x_scales = XS + rows.to(tl.int64) * stride_xsm
        acc = tl.zeros((BLOCK_W, BLOCK_X), dtype=tl.float32)
        for ki in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + ks[None, :])  # [BLOCK_W, BLOCK_K] e4m3
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            a_s = tl.load(x_scales + ki, mask=row_ok, other=0.0)
            # dot_rows's step, transposed: (activation scale x weight scale) times the product
            acc += tl.dot(w, tl.trans(a)) * (a_s[None, :] * tl.load(w_scales + ki))
        out = acc.to(OUT.dtype.element_ty)
        if HAS_BIAS:  # added after the cast, as fp8_gemm adds it to cuBLASLt's output
            bias = tl.load(BIAS + cols, mask=col_ok, other=0.0)
            out = (out.to(tl.float32) + bias.to(tl.float32)[:, None]).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[None, :] * stride_om + cols[:, None], out,
                 mask=row_ok[None, :] & col_ok[:, None])
    # fmt: on

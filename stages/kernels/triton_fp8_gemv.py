"""W8A8 block-scaled linears of a few rows (a decode step of one to four requests) as one Triton
GEMV: fp8_ref.linear's contract, the activations quantized in 1 x 128 groups inside the kernel
(triton_fp8_act's arithmetic: the group's largest magnitude, floored, times 1/448; IEEE
division; e4m3 round-to-nearest), the weights e4m3 with 128 x 128 scales.

cuBLASLt's block-scaled GEMM tiles 128 x 128 for any row count: a one-row step's FP8 linears
took 0.54 ms of session 16's 2.99 ms step (docs/bench/session16/call2/v4_decode_fp8.json) for
about 0.85 GB of weights by our count, ~1.6 TB/s, after a quantizer launch each. Here each
program, one warp, reads BLOCK_N weight rows along all of K (STAGES K steps in flight),
multiplies them on the CUDA cores with the quantized rows (exact fp8 products, fp32 sums per
128-wide block, each block's sum scaled by the row's and the block's scales), so a 32K-row
projection runs 2,048 programs, an SM holds a dozen of them (by their registers and shared
memory in the sm_90 compile), and the quantizer is no launch of its own. One warp a program
keeps each K step's reductions (the group's maximum, a weight row's sum) to shuffles: at four
warps the compiler split the activations across warps and put seven barriers in every step.
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_ref, triton_fp8_act

GEMV_ROWS = 4  # rows a call takes; more go to the GEMMs
BLOCK_N = 16  # weight rows a program
STAGES = 8  # K steps in flight a program (2 KB of weights each)
WARPS = 1  # a program one warp: its reductions shuffles, no barrier between warps


def takes(rows: int, n: int, k: int) -> bool:
    return 1 <= rows <= GEMV_ROWS and k % fp8_ref.BLOCK == 0 and n >= 1


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (at most GEMV_ROWS rows), weight [N, K] e4m3, scale_inv [ceil(N/128), K/128]
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
) -> torch.Tensor:
    n, k = weight.shape
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if flat.shape[1] != (2 * k if swiglu else k) or not takes(m, n, k):
        raise ValueError(f"the FP8 GEMV takes 1 to {GEMV_ROWS} rows and K on the 128 grid")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    scales = scale_inv.float().contiguous()
    _gemv_w8a8[(triton.cdiv(n, BLOCK_N),)](
        flat, weight, scales, weight if bias is None else bias, out, m, n, k, flat.stride(0),
        weight.stride(0), scales.stride(0), out.stride(0),
        0.0 if limit is None else triton_fp8_act.rounded(limit, x.dtype),
        HAS_BIAS=bias is not None, SWIGLU=swiglu, HAS_LIMIT=limit is not None,
        CUDA_EXP=x.is_cuda, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=BLOCK_N,
        BLOCK_K=fp8_ref.BLOCK, INV_FP8_MAX=1 / fp8_ref.FP8_MAX, MIN_SCALE=fp8_ref.MIN_SCALE,
        STAGES=STAGES, num_warps=WARPS,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.triton_fp8_act import swiglu_steps

    # fmt: off
    @triton.jit  # type: ignore[untyped-decorator]
    def _gemv_w8a8(  # type: ignore[no-untyped-def]
        X, W, WS, BIAS, OUT, M, N, K, stride_xm, stride_wn, stride_wsn, stride_om, limit,
        HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
        CUDA_EXP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """SWIGLU: X's rows are gate | up (2K wide), the swiglu's steps before the quantizer."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_rows = W + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_wn
        w_scales = WS + (tl.where(col_ok, cols, 0) // BLOCK_K).to(tl.int64) * stride_wsn
        rows = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + ks[None, :]).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            w_s = tl.load(w_scales + ki)
            # a row at a time: its K block, a weight row's sum, stay within a warp's lanes
            for m in tl.static_range(BLOCK_M):
                x_ptrs = X + m * stride_xm + ks
                if SWIGLU:
                    gate = tl.load(x_ptrs, mask=m < M, other=0.0)
                    up = tl.load(x_ptrs + K, mask=m < M, other=0.0)
                    x = swiglu_steps(gate, up, limit, HAS_LIMIT, CUDA_EXP)
                else:
                    x = tl.load(x_ptrs, mask=m < M, other=0.0).to(tl.float32)
                # triton_fp8_act's quantizer, to the bit: the e4m3 values, read back exactly
                a_s = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_SCALE) * INV_FP8_MAX
                a_q = tl.div_rn(x, tl.zeros_like(x) + a_s).to(tl.float8e4nv).to(tl.float32)
                part = tl.sum(w * a_q[None, :], axis=1) * (a_s * w_s)
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + rows[:, None] * stride_om + cols[None, :],
                 acc.to(OUT.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])
    # fmt: on

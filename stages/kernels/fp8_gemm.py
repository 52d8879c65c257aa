"""W8A8 block-scaled FP8 linears on CUDA: the contract of fp8_ref.linear.

- ``linear_scaled_mm``: ``torch.nn.functional.scaled_mm`` (``torch._scaled_mm`` where torch
  predates it) with BlockWise1x128 activations and BlockWise128x128 weights (cuBLASLt on SM90),
  the weight scales as the checkpoint stores them. Where (K / 128) % 4 != 0 torch 2.11 refuses
  them (it wants the K-block count rounded up to 4), and K or N off the 128 grid it does not
  take: those shapes go to the Triton kernel.
- ``linear`` / ``linear_sm1``: a persistent Triton GEMM (grid = SMs, or SMs - 1 leaving an SM to
  a waiting NCCL recv, as stages/kernels/triton_gemm.py) over 128 x 128 tiles of K: each K tile
  is one activation group and one weight block, so its partial product takes one scale per row
  times one per tile.

Activations are quantized by fp8_ref.quantize_act. Anything not on CUDA goes to fp8_ref.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.kernels import fp8_ref
from stages.kernels.triton_gemm import num_sms

BLOCK = fp8_ref.BLOCK
BLOCK_M = 64  # rows per tile: decode batches are short


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None and torch.cuda.get_device_capability()[0] >= 9


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def linear(x, weight, scale_inv, bias=None) -> torch.Tensor:
    return _triton_linear(x, weight, scale_inv, bias, sm_margin=0)


def linear_sm1(x, weight, scale_inv, bias=None) -> torch.Tensor:
    return _triton_linear(x, weight, scale_inv, bias, sm_margin=1)


def linear_scaled_mm(x, weight, scale_inv, bias=None) -> torch.Tensor:
    n, k = weight.shape
    if not x.is_cuda or k % BLOCK or n % BLOCK or (k // BLOCK) % 4:
        return linear(x, weight, scale_inv, bias)
    q, s = fp8_ref.quantize_act(_flat(x))
    m, groups = s.shape
    # rows padded to 16 (cuBLASLt's FP8 alignment), the scales outer-dim-major ([groups, M])
    rows = m + (-m % 16)
    if rows != m:
        q = torch.cat((q, q.new_zeros(rows - m, k)))
    sa = torch.ones(groups, rows, dtype=torch.float32, device=x.device)
    sa[:, :m] = s.T
    scale_a, scale_b = sa.T, scale_inv.float().T  # [M, K / 128], [K / 128, N / 128]
    if hasattr(F, "scaled_mm"):
        out = F.scaled_mm(
            q,
            weight.T,
            scale_a,
            F.ScalingType.BlockWise1x128,
            scale_b,
            F.ScalingType.BlockWise128x128,
            swizzle_a=F.SwizzleType.NO_SWIZZLE,
            swizzle_b=F.SwizzleType.NO_SWIZZLE,
            output_dtype=x.dtype,
        )
    else:  # older torch: the recipe follows from the scales' shapes
        out = torch._scaled_mm(q, weight.T, scale_a, scale_b, out_dtype=x.dtype)
    out = out[:m]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def _triton_linear(x, weight, scale_inv, bias, sm_margin: int) -> torch.Tensor:
    if triton is None or not x.is_cuda:
        return fp8_ref.linear(x, weight, scale_inv, bias)
    n, k = weight.shape
    q, s = fp8_ref.quantize_act(_flat(x))
    m = q.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = scale_inv.float().contiguous()
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK)
    progs = max(1, min(num_sms(x.device) - sm_margin, tiles))
    _w8a8[(progs,)](
        q,
        s,
        weight,
        ws,
        out,
        bias if bias is not None else out,
        m,
        n,
        k,
        progs,
        q.stride(0),
        s.stride(0),
        weight.stride(0),
        ws.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK,
        BLOCK_K=BLOCK,
        GROUP_M=8,
        num_warps=4,
        num_stages=3,
    )
    return out.view(*x.shape[:-1], n)


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.triton_gemm import _tile_coords

    @triton.jit
    def _w8a8(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        bias_ptr,
        M,
        N,
        K,
        num_progs,
        stride_am,
        stride_as,
        stride_wn,
        stride_ws,
        stride_cm,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        num_tiles = num_pid_m * num_pid_n
        for tile_id in tl.range(start, num_tiles, num_progs):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows_safe = tl.where(rows < M, rows, 0).to(tl.int64)
            cols_safe = tl.where(cols < N, cols, 0).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                ks = ki * BLOCK_K + tl.arange(0, BLOCK_K)
                kmask = ks[None, :] < K
                a = tl.load(
                    a_ptr + rows_safe[:, None] * stride_am + ks[None, :], mask=kmask, other=0.0
                )
                w = tl.load(
                    w_ptr + cols_safe[:, None] * stride_wn + ks[None, :], mask=kmask, other=0.0
                )
                a_s = tl.load(as_ptr + rows_safe * stride_as + ki)
                w_s = tl.load(ws_ptr + pid_n * stride_ws + ki)
                acc += tl.dot(a, w.T) * (a_s[:, None] * w_s)
            if HAS_BIAS:
                b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
                acc = acc + b.to(tl.float32)[None, :]
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

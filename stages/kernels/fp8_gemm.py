"""W8A8 block-scaled FP8 linears on CUDA: the contract of fp8_ref.linear.

- ``linear_scaled_mm``: ``torch.nn.functional.scaled_mm`` (``torch._scaled_mm`` where torch
  predates it) with BlockWise1x128 activations and BlockWise128x128 weights (cuBLASLt on SM90),
  the weight scales as the checkpoint stores them. Where (K / 128) % 4 != 0 torch 2.11 refuses
  them (it wants the K-block count rounded up to 4), and K or N off the 128 grid it does not
  take: those shapes go to the Triton kernel.
- ``linear`` / ``linear_sm1``: stages/kernels/triton_gemm.py's persistent pointer-load GEMM
  (grid = SMs, or SMs - 1 leaving an SM to a waiting NCCL recv) in its block-scaled mode, with
  128-wide N and K tiles: each K tile is one activation group and one weight block, so its
  partial product takes one scale per row times one per tile.

Activations are quantized by stages/kernels/triton_fp8_act.py (fp8_ref.quantize_act's numbers in
one kernel, already in the layout each GEMM reads). Every call is device-only with a fixed grid
(CUDA graphs capture it). Anything not on CUDA goes to fp8_ref; every such route is counted and
logged once (stages/kernels/fallbacks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.kernels import fp8_ref, triton_fp8_act, triton_gemm
from stages.kernels.fallbacks import record_fallback
from stages.kernels.triton_gemm import GemmConfig, num_sms

BLOCK = fp8_ref.BLOCK
# 64 rows per tile (decode batches are short); N and K tiles are the scales' 128 blocks
TILES = GemmConfig(
    block_m=64, block_n=BLOCK, block_k=BLOCK, group_m=8, num_stages=3, num_warps=4, tma=False
)


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None and torch.cuda.get_device_capability()[0] >= 9


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _triton_linear(x, weight, scale_inv, bias, sm_margin=0)


def linear_sm1(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _triton_linear(x, weight, scale_inv, bias, sm_margin=1)


def linear_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    n, k = weight.shape
    if not x.is_cuda or k % BLOCK or n % BLOCK or (k // BLOCK) % 4:
        reason = "shape" if x.is_cuda else "device"
        detail = f"N {n}, K {k} (multiples of 128, K / 128 of 4) -> triton-persistent"
        record_fallback("fp8_linear", "scaled-mm", reason, detail)
        return linear(x, weight, scale_inv, bias)
    m = _flat(x).shape[0]
    # rows padded to 16 (cuBLASLt's FP8 alignment), the scales outer-dim-major: [M, K / 128]
    # with unit stride along M, written so by the quantizer
    q, scale_a = triton_fp8_act.quantize_act(_flat(x), rows_multiple=16, group_major=True)
    scale_b = scale_inv.float().T  # [K / 128, N / 128]
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


def _triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    sm_margin: int,
) -> torch.Tensor:
    if triton is None or not x.is_cuda:
        backend = "triton-persistent-sm1" if sm_margin else "triton-persistent"
        reason = "device" if not x.is_cuda else "no_triton"
        record_fallback("fp8_linear", backend, reason, f"{x.device} -> fp8_ref")
        return fp8_ref.linear(x, weight, scale_inv, bias)
    n, k = weight.shape
    q, s = triton_fp8_act.quantize_act(_flat(x))
    out = torch.empty(q.shape[0], n, dtype=x.dtype, device=x.device)
    grid = num_sms(x.device) - sm_margin
    triton_gemm.launch_ptr(
        q, weight.contiguous(), bias, out, grid, TILES, s, scale_inv.float().contiguous()
    )
    return out.view(*x.shape[:-1], n)


try:
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

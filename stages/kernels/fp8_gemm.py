"""W8A8 block-scaled FP8 linears on CUDA: the contract of fp8_ref.linear.

- ``linear_scaled_mm``: ``torch.nn.functional.scaled_mm`` (``torch._scaled_mm`` where torch
  predates it) with BlockWise1x128 activations and BlockWise128x128 weights (cuBLASLt on SM90),
  the weight scales as the checkpoint stores them. Where (K / 128) % 4 != 0 torch 2.11 refuses
  them (it wants the K-block count rounded up to 4), and K or N off the 128 grid it does not
  take: those shapes go to the Triton kernel.
- ``linear_decode_scaled_mm`` / ``swiglu_linear_decode_scaled_mm``: up to
  triton_fp8_decode_linear.DECODE_ROWS rows (a decode step) the Triton tensor-core kernel with
  the weights as the MMA's wide side (its rows quantized first, as for cuBLASLt), more rows the
  scaled_mm ones.
- ``linear`` / ``linear_sm1``: stages/kernels/triton_gemm.py's persistent pointer-load GEMM
  (grid = SMs, or SMs - 1 leaving an SM to a waiting NCCL recv) in its block-scaled mode, with
  128-wide N and K tiles: each K tile is one activation group and one weight block, so its
  partial product takes one scale per row times one per tile.

``swiglu_linear_scaled_mm`` / ``swiglu_linear`` / ``swiglu_linear_sm1`` (the fp8_swiglu_linear op:
fp8_ref.swiglu_linear's contract) take a SwiGLU's gate | up and fold its swiglu into the
activations' quantizer.

Activations are quantized by stages/kernels/triton_fp8_act.py (fp8_ref.quantize_act's numbers in
one kernel, already in the layout each GEMM reads). Every call is device-only with a fixed grid
(CUDA graphs capture it). Anything not on CUDA goes to fp8_ref; every such route is counted and
logged once (stages/kernels/fallbacks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.kernels import fp8_ref, triton_fp8_act, triton_fp8_decode_linear, triton_gemm
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
    if not _scaled_mm_takes(x, n, k):
        return linear(x, weight, scale_inv, bias)
    # rows padded to 16 (cuBLASLt's FP8 alignment), the scales outer-dim-major: [M, K / 128]
    # with unit stride along M, written so by the quantizer
    q, scale_a = triton_fp8_act.quantize_act(_flat(x), rows_multiple=16, group_major=True)
    out = _scaled_mm(q, scale_a, weight, scale_inv, bias, x.dtype)[: _flat(x).shape[0]]
    return out.reshape(*x.shape[:-1], n)


def linear_decode_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if _decode_takes(x, weight):
        return triton_fp8_decode_linear.linear(x, weight, scale_inv, bias)
    return linear_scaled_mm(x, weight, scale_inv, bias)


def swiglu_linear_decode_scaled_mm(
    gate_up: torch.Tensor,
    limit: float | None,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if _decode_takes(gate_up, weight):
        return triton_fp8_decode_linear.swiglu_linear(gate_up, limit, weight, scale_inv, bias)
    return swiglu_linear_scaled_mm(gate_up, limit, weight, scale_inv, bias)


def _decode_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the decode linear takes x's rows (on CUDA, with triton)."""
    n, k = weight.shape
    rows = _flat(x).shape[0]
    return x.is_cuda and triton is not None and triton_fp8_decode_linear.takes(rows, n, k)


def swiglu_linear_scaled_mm(
    gate_up: torch.Tensor,
    limit: float | None,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear_scaled_mm(swiglu(gate, up, limit), ...) with the swiglu and the quantizer one
    kernel (triton_fp8_act.swiglu_quantize_act): the same bits."""
    n, k = weight.shape
    if not _scaled_mm_takes(gate_up, n, k):
        return swiglu_linear(gate_up, limit, weight, scale_inv, bias)
    flat = _flat(gate_up)
    q, scale_a = triton_fp8_act.swiglu_quantize_act(flat, limit, rows_multiple=16, group_major=True)
    out = _scaled_mm(q, scale_a, weight, scale_inv, bias, gate_up.dtype)[: flat.shape[0]]
    return out.reshape(*gate_up.shape[:-1], n)


def _scaled_mm_takes(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether cuBLASLt's blockwise FP8 GEMM takes these shapes (counted and logged if not)."""
    if not x.is_cuda or k % BLOCK or n % BLOCK or (k // BLOCK) % 4:
        reason = "shape" if x.is_cuda else "device"
        detail = f"N {n}, K {k} (multiples of 128, K / 128 of 4) -> triton-persistent"
        record_fallback("fp8_linear", "scaled-mm", reason, detail)
        return False
    return True


def _scaled_mm(
    q: torch.Tensor,
    scale_a: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[R, N]: q [R, K] e4m3 with its group-major 1 x 128 scales times the 128 x 128-scaled
    weight."""
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
            output_dtype=dtype,
        )
    else:  # older torch: the recipe follows from the scales' shapes
        out = torch._scaled_mm(q, weight.T, scale_a, scale_b, out_dtype=dtype)
    if bias is not None:
        out = out + bias
    return out


def swiglu_linear(
    gate_up: torch.Tensor,
    limit: float | None,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _triton_linear(gate_up, weight, scale_inv, bias, sm_margin=0, swiglu_limit=(limit,))


def swiglu_linear_sm1(
    gate_up: torch.Tensor,
    limit: float | None,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _triton_linear(gate_up, weight, scale_inv, bias, sm_margin=1, swiglu_limit=(limit,))


def _triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    sm_margin: int,
    swiglu_limit: tuple[float | None] | None = None,
) -> torch.Tensor:
    """swiglu_limit: x is [..., 2K] gate | up, and the product's input swiglu(gate, up, limit)
    (quantized by the same kernel)."""
    if triton is None or not x.is_cuda:
        backend = "triton-persistent-sm1" if sm_margin else "triton-persistent"
        reason = "device" if not x.is_cuda else "no_triton"
        record_fallback("fp8_linear", backend, reason, f"{x.device} -> fp8_ref")
        if swiglu_limit is not None:
            return fp8_ref.swiglu_linear(x, swiglu_limit[0], weight, scale_inv, bias)
        return fp8_ref.linear(x, weight, scale_inv, bias)
    n, k = weight.shape
    if swiglu_limit is None:
        q, s = triton_fp8_act.quantize_act(_flat(x))
    else:
        q, s = triton_fp8_act.swiglu_quantize_act(_flat(x), swiglu_limit[0])
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

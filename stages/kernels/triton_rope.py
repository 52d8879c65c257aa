"""The `rope_tail` op (stages/kernels/rope_tail.py) in one Triton kernel: per token and block
of heads, the optional unweighted RMS norm over the head and the interleaved rotation of its
trailing r channels, in place. The torch form took about seven passes (an fp32 copy, the
square, the mean, the product, the slice's cast, the flip, the products and sum, a full clone)
over tensors as large as V4's [T, 64, 512] query; here the rotation alone touches only the r
channels, and with the norm each head is read and written once.

The same roundings as the torch form: products and sums in fp32 without FMA contraction
(``enable_fp_fusion=False``), the unweighted norm's factor rounded to x's dtype before the
product (the weighted one's kept in fp32, then times the weight), and libdevice's rsqrtf
(torch's). Only the order of the norm's sum of squares differs. x must be
[T, D] or [T, H, D] with unit stride along D and r a power of two; anything else, other
devices, or no triton take the torch form, counted and logged once
(stages/kernels/fallbacks.py).

`rms_norm` is the `rms_norm_fp32` op (rope_tail.fp32_rms_norm, V4RMSNorm's norm without a
rotation) the same way: one kernel reading x and writing the result in x's dtype, where torch
took three (the fp32 copy, its fused rms_norm, the cast back).
"""

from __future__ import annotations

import torch

from stages.kernels import pdl
from stages.kernels import rope_tail as reference
from stages.kernels.fallbacks import record_fallback

# per program: heads x the head (with the norm) or x its r rotated channels (without); the best
# of a sweep at V4-Flash's [8192, 64, 512] (docs/bench/session13/call2/sweep.jsonl)
ELEMENTS_NORM, ELEMENTS_ROTATE = 2048, 512


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None


def rope_tail(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_eps: float | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    reason = _refusal(x, cos, sin, norm_eps, weight)
    if reason is not None:
        if x.shape[0]:  # an empty batch does no work on either path
            detail = f"x {tuple(x.shape)} {x.dtype} on {x.device}, r {cos.shape[-1]} -> torch"
            record_fallback("rope_tail", "triton", reason, detail)
        return reference.rope_tail(x, cos, sin, norm_eps, weight)
    return launch(x, cos, sin, norm_eps, weight)


def _input_refusal(x: torch.Tensor, weight: torch.Tensor | None) -> str | None:
    """What both kernels refuse: no triton, x off CUDA or in another dtype, a weight not
    [D] fp32 with unit stride."""
    if triton is None:
        return "no_triton"
    if not x.is_cuda:
        return "device"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return "dtype"
    if weight is not None and (weight.dtype != torch.float32 or weight.stride(-1) != 1):
        return "dtype"
    if weight is not None and weight.shape != (x.shape[-1],):
        return "shape"
    return None


def _refusal(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_eps: float | None,
    weight: torch.Tensor | None,
) -> str | None:
    r = cos.shape[-1]
    reason = _input_refusal(x, weight)
    if reason is not None:
        return reason
    if x.shape[0] == 0 or x.dim() not in (2, 3) or x.stride(-1) != 1:
        return "shape"
    if r & (r - 1) or r < 2 or r > x.shape[-1] or (x.shape[-1] - r) % 2:
        return "shape"
    if cos.shape != (x.shape[0], r) or sin.shape != cos.shape or cos.stride(-1) != 1:
        return "shape"
    if sin.stride(-1) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return "shape"
    if weight is not None and norm_eps is None:
        return "shape"
    return None


def launch(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_eps: float | None,
    weight: torch.Tensor | None = None,
    elements: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it);
    elements / num_warps: the tile (docs/bench/scripts/session13_sweep.py sweeps them)."""
    t, d, r = x.shape[0], x.shape[-1], cos.shape[-1]
    heads, stride_h = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    norm = norm_eps is not None
    block_d = triton.next_power_of_2(d)
    if elements is None:
        elements = ELEMENTS_NORM if norm else ELEMENTS_ROTATE
    block_h = max(1, min(triton.next_power_of_2(heads), elements // (block_d if norm else r)))
    options = {"enable_fp_fusion": False} if x.is_cuda else {}
    _rope_tail[(t, triton.cdiv(heads, block_h))](
        x, cos, sin, cos if weight is None else weight, heads, d, x.stride(0), stride_h,
        cos.stride(0), sin.stride(0),
        1.0 / d, 0.0 if norm_eps is None else norm_eps,
        R=r, NORM=norm, WEIGHTED=weight is not None, CUDA_RSQRT=x.is_cuda, BLOCK_H=block_h,
        BLOCK_D=block_d, num_warps=num_warps,
        **options, **pdl.options(x),
    )  # fmt: skip
    return x


ANGLE_ROWS = 16  # positions per program of rope_angles


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tail.rope_angles in one kernel (the torch form took about twelve)."""
    if triton is None or not positions.is_cuda or inv_freq.dtype != torch.float32:
        if positions.numel():
            reason = (
                "no_triton" if triton is None else "device" if not positions.is_cuda else "dtype"
            )
            record_fallback("rope_angles", "triton", reason, f"{positions.device} -> torch")
        return reference.rope_angles(positions, inv_freq, scaling, dtype)
    return launch_angles(positions, inv_freq, scaling, dtype)


def launch_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it)."""
    n, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(n, 2 * half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        options = {"enable_fp_fusion": False} if positions.is_cuda else {}
        _rope_angles[(triton.cdiv(n, ANGLE_ROWS),)](
            positions, inv_freq.contiguous(), cos, sin, n, half, scaling,
            ROUND_BF16=dtype == torch.bfloat16, ROUND_F16=dtype == torch.float16,
            CUDA_MATH=positions.is_cuda, BLOCK_N=ANGLE_ROWS,
            BLOCK_H=triton.next_power_of_2(half), num_warps=1, **options, **pdl.options(cos),
        )  # fmt: skip
    return cos, sin


NORM_ROWS = 4  # rows per program of rms_norm (a 4096-wide V4 hidden row is 16 KiB in fp32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rope_tail.fp32_rms_norm(x, weight, eps) for x [..., D] in one kernel."""
    reason = _input_refusal(x, weight)
    if reason is not None or x.numel() == 0:
        if reason is not None and x.numel():
            detail = f"x {tuple(x.shape)} {x.dtype} on {x.device} -> torch"
            record_fallback("rms_norm_fp32", "triton", reason, detail)
        return reference.fp32_rms_norm(x, weight, eps)
    return launch_rms_norm(x, weight, eps)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it)."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    options = {"enable_fp_fusion": False} if x.is_cuda else {}
    _rms_norm[(triton.cdiv(rows.shape[0], NORM_ROWS),)](
        rows, weight, out, rows.shape[0], d, rows.stride(0), out.stride(0),
        1.0 / d, eps,
        CUDA_RSQRT=x.is_cuda, BLOCK_R=NORM_ROWS, BLOCK_D=triton.next_power_of_2(d),
        num_warps=8, **options, **pdl.options(out),
    )  # fmt: skip
    return out.view(x.shape)


try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from stages.kernels.pdl import enter
    # fmt: off

    @triton.jit  # type: ignore[untyped-decorator]
    def _rope_tail(  # type: ignore[no-untyped-def]
        x_ptr, cos_ptr, sin_ptr, w_ptr, H, D, stride_t, stride_h, stride_c, stride_s, inv_d,
        eps, R: tl.constexpr, NORM: tl.constexpr, WEIGHTED: tl.constexpr,
        CUDA_RSQRT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_h = (heads < H)[:, None]
        row = x_ptr + t * stride_t + heads.to(tl.int64)[:, None] * stride_h
        rot = tl.arange(0, R)
        tail = D - R + rot
        c = tl.load(cos_ptr + t * stride_c + rot)[None, :]
        s = tl.load(sin_ptr + t * stride_s + rot)[None, :]
        own = tl.load(row + tail[None, :], mask=in_h, other=0.0)
        partner = tl.load(row + (tail ^ 1)[None, :], mask=in_h, other=0.0)  # its pair's other
        dtype = own.dtype
        if NORM:
            cols = tl.arange(0, BLOCK_D)[None, :]
            head = tl.load(row + cols, mask=in_h & (cols < D), other=0.0).to(tl.float32)
            mean = tl.sum(head * head, axis=1) * inv_d
            if CUDA_RSQRT:  # rsqrtf, as torch.rsqrt on CUDA
                factor = libdevice.rsqrt(mean + eps)
            else:  # Triton's interpreter: 1 / sqrt, as torch.rsqrt on the CPU
                factor = 1.0 / tl.sqrt(mean + eps)
            factor = factor[:, None]
            if WEIGHTED:  # (x * factor) * weight in fp32, cast once (V4RMSNorm)
                w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
                w_own = tl.load(w_ptr + tail)[None, :]
                w_partner = tl.load(w_ptr + (tail ^ 1))[None, :]
                own = (own.to(tl.float32) * factor * w_own).to(dtype)
                partner = (partner.to(tl.float32) * factor * w_partner).to(dtype)
                normed = (head * factor * w).to(dtype)
            else:  # the factor rounded to x's dtype first (unweighted_rms_norm)
                factor = factor.to(dtype).to(tl.float32)
                own = (own.to(tl.float32) * factor).to(dtype)
                partner = (partner.to(tl.float32) * factor).to(dtype)
                normed = (head * factor).to(dtype)
            tl.debug_barrier()  # every read of the heads before any write
            tl.store(row + cols, normed, mask=in_h & (cols < D - R))
        else:
            tl.debug_barrier()
        rotated = own.to(tl.float32) * c + partner.to(tl.float32) * s
        tl.store(row + tail[None, :], rotated.to(dtype), mask=in_h)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rope_angles(  # type: ignore[no-untyped-def]
        pos_ptr, inv_ptr, cos_ptr, sin_ptr, N, HALF, scaling, ROUND_BF16: tl.constexpr,
        ROUND_F16: tl.constexpr, CUDA_MATH: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """cos / signed sin per channel of positions x inv_freq (rope_tail.rope_angles)."""
        enter(PDL)
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        j = tl.arange(0, BLOCK_H)
        ok = (rows < N)[:, None] & (j < HALF)[None, :]
        pos = tl.load(pos_ptr + rows, mask=rows < N, other=0).to(tl.float32)
        freqs = pos[:, None] * tl.load(inv_ptr + j, mask=j < HALF, other=0.0)[None, :]
        if CUDA_MATH:  # cosf / sinf, as torch's on CUDA
            c, s = libdevice.cos(freqs), libdevice.sin(freqs)
        else:
            c, s = tl.cos(freqs), tl.sin(freqs)
        c, s = c * scaling, s * scaling
        if ROUND_BF16:  # the model dtype's rounding, as transformers casts them
            c, s = c.to(tl.bfloat16).to(tl.float32), s.to(tl.bfloat16).to(tl.float32)
        if ROUND_F16:
            c, s = c.to(tl.float16).to(tl.float32), s.to(tl.float16).to(tl.float32)
        base = rows[:, None] * (2 * HALF) + 2 * j[None, :]
        tl.store(cos_ptr + base, c, mask=ok)
        tl.store(cos_ptr + base + 1, c, mask=ok)
        tl.store(sin_ptr + base, -s, mask=ok)
        tl.store(sin_ptr + base + 1, s, mask=ok)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rms_norm(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, out_ptr, N, D, stride_x, stride_o, inv_d, eps,
        CUDA_RSQRT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """out = (x * rsqrt(mean(x^2) + eps)) * w in fp32, cast to x's dtype, per row."""
        enter(PDL)
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (rows < N) & (cols < D)
        v = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
        h = v.to(tl.float32)
        mean = tl.sum(h * h, axis=1) * inv_d
        if CUDA_RSQRT:  # rsqrtf, as torch's rms_norm on CUDA
            factor = libdevice.rsqrt(mean + eps)
        else:  # Triton's interpreter: 1 / sqrt
            factor = 1.0 / tl.sqrt(mean + eps)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        tl.store(out_ptr + rows * stride_o + cols, (h * factor[:, None] * w).to(v.dtype), mask=mask)
    # fmt: on

"""fp8_ref.quantize_act (1 x 128 groups along K, e4m3, one float32 scale per row and group: the
group's largest magnitude, floored at fp8_ref.MIN_SCALE, times the float32 reciprocal of 448) in
one Triton kernel, with the same bits: the values divided by their scale with IEEE rounding
(Triton's default float32 division is approximate), then e4m3's round-to-nearest-even.

It writes what the W8A8 GEMMs read directly, so a call is one launch with static shapes (what a
CUDA graph captures): rows padded to a multiple (cuBLASLt's FP8 GEMM wants 16; the padding rows
are zeros with scale 1), and the scales either row-major [rows, groups] (the Triton GEMMs) or
group-major, a [rows, groups] view of a [groups, rows] buffer (``F.scaled_mm``'s BlockWise1x128
layout). Anything not on CUDA goes through fp8_ref; so does a CUDA input without triton, counted
and logged once (stages/kernels/fallbacks.py). `swiglu_quantize_act` is the same quantizer fed by
the grouped MoE's silu(gate) * up in the same kernel.
"""

from __future__ import annotations

import torch

from stages.kernels import fp8_ref, pdl
from stages.kernels.fallbacks import record_fallback

# (rows a program, warps): each program quantizes one 128-wide group of its rows. LAUNCH: the
# plain quantizer's (every launch swept within 4 % of it), SWIGLU_LAUNCH: the SwiGLU one's (the
# fastest swept): `python -m app.bench.fp8 --act-quantizers`, docs/PERFORMANCE.md (session 29)
LAUNCH = (16, 4)
SWIGLU_LAUNCH = (8, 4)


def quantize_act(
    x: torch.Tensor, rows_multiple: int = 1, group_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [R, K] e4m3, scale [R, cdiv(K, 128)] fp32), R = M rounded up to
    rows_multiple; q[:M], scale[:M] equal fp8_ref.quantize_act(x). group_major: the scales are
    a view of a contiguous [groups, R] tensor."""
    if x.dim() != 2:
        raise ValueError(f"quantize_act takes x [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if triton is None or not x.is_cuda:
        if x.is_cuda:  # off CUDA fp8_ref is the one path
            record_fallback("fp8_act_quant", "triton", "no_triton", "-> fp8_ref")
        return _reference(x, m + (-m % rows_multiple), group_major)
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, scale = _buffers(m, k, rows_multiple, group_major, x.device)
    rows, groups = q.shape[0], scale.shape[1]
    if rows:
        block_m, warps = LAUNCH
        _quantize_1x128[(triton.cdiv(rows, block_m), groups)](
            x,
            q,
            scale,
            m,
            rows,
            k,
            x.stride(0),
            q.stride(0),
            scale.stride(0),
            scale.stride(1),
            INV_FP8_MAX=1 / fp8_ref.FP8_MAX,
            MIN_SCALE=fp8_ref.MIN_SCALE,
            BLOCK_M=block_m,
            GROUP=fp8_ref.BLOCK,
            num_warps=warps,
            **pdl.options(x),
        )
    return q, scale


def swiglu_quantize_act(
    gate_up: torch.Tensor,
    limit: float | None = None,
    rows_multiple: int = 1,
    group_major: bool = False,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (the gate and up halves side by side) -> quantize_act(torch_ref.swiglu(
    gate, up, limit), rows_multiple, group_major) in one kernel: the activation between a SwiGLU's
    GEMMs (the grouped MoE's, the shared experts' and dense MLPs' W8A8 down projections), where
    the clamps, silu, product and quantizer were five passes over [rows, I] in torch (the clamps
    alone took 8 ms of V4-Flash's FP8 8K chunk). The same bits as the unfused path: torch's
    rounding steps, IEEE divisions and libdevice's expf, the one torch's silu calls.
    live [M] (the grouped MoE's pair_of_row): only rows with live >= 0 are read and written, the
    others (the layout's expert padding) left as they were, their scales included."""
    from stages.kernels import torch_ref

    width = gate_up.shape[1]
    if triton is None or not gate_up.is_cuda or width % 2 or gate_up.stride(-1) != 1:
        half = width // 2
        h = torch_ref.swiglu(gate_up[:, :half], gate_up[:, half:], limit)
        return quantize_act(h, rows_multiple, group_major)
    return _swiglu_quantize(gate_up, limit, rows_multiple, group_major, live)


def _buffers(
    m: int, k: int, rows_multiple: int, group_major: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, K] e4m3, scale [R, groups] fp32, group-major or not), R = M rounded up."""
    rows = m + (-m % rows_multiple)
    groups = -(-k // fp8_ref.BLOCK)
    q = torch.empty(rows, k, dtype=fp8_ref.FP8, device=device)
    if group_major:
        scale = torch.empty(groups, rows, dtype=torch.float32, device=device).T
    else:
        scale = torch.empty(rows, groups, dtype=torch.float32, device=device)
    return q, scale


def _swiglu_quantize(
    gate_up: torch.Tensor,
    limit: float | None,
    rows_multiple: int = 1,
    group_major: bool = False,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch (any device Triton runs on: its interpreter's tests call it)."""
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale = _buffers(m, inter, rows_multiple, group_major, gate_up.device)
    rows, groups = q.shape[0], scale.shape[1]
    if rows:
        block_m, warps = SWIGLU_LAUNCH
        _swiglu_quantize_1x128[(triton.cdiv(rows, block_m), groups)](
            gate_up, q, scale, gate_up if live is None else live, m, rows, inter,
            gate_up.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            0.0 if limit is None else rounded(limit, gate_up.dtype), HAS_LIMIT=limit is not None,
            HAS_LIVE=live is not None, CUDA_EXP=gate_up.is_cuda,
            INV_FP8_MAX=1 / fp8_ref.FP8_MAX, MIN_SCALE=fp8_ref.MIN_SCALE, BLOCK_M=block_m,
            GROUP=fp8_ref.BLOCK, num_warps=warps, **pdl.options(gate_up),
        )  # fmt: skip
    return q, scale


def rounded(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as torch rounds a clamp's bound against a tensor of it."""
    return float(torch.tensor(value, dtype=dtype))


def _reference(x: torch.Tensor, rows: int, group_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same outputs from fp8_ref (padding and layout included)."""
    q, s = fp8_ref.quantize_act(x)
    m, k = x.shape
    if rows != m:
        q = torch.cat((q, q.new_zeros(rows - m, k)))
        s = torch.cat((s, s.new_ones(rows - m, s.shape[1])))
    if group_major:
        s = s.new_empty(s.shape[1], rows).copy_(s.T).T
    return q, s


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
    def _quantize_store(  # type: ignore[no-untyped-def]
        x, r64, cols, group, real, kept, q_ptr, s_ptr, K, stride_qm, stride_sm, stride_sg,
        INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    ):
        """x [rows, GROUP] fp32 (zeros outside the rows and K) quantized into q and s at the
        rows r64 (int64) where `kept`; a kept row that is not `real` (padding: zeros) keeps a
        scale of 1, as a GEMM over it expects nothing else."""
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_SCALE) * INV_FP8_MAX
        q = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        tl.store(
            q_ptr + r64[:, None] * stride_qm + cols[None, :],
            q.to(tl.float8e4nv),
            mask=kept[:, None] & (cols[None, :] < K),
        )
        tl.store(s_ptr + r64 * stride_sm + group * stride_sg, tl.where(real, scale, 1.0),
                 mask=kept)

    @triton.jit  # type: ignore[untyped-decorator]
    def swiglu_steps(gate, up, limit, HAS_LIMIT: tl.constexpr, CUDA_EXP: tl.constexpr):  # type: ignore[no-untyped-def]
        """torch_ref.swiglu's steps on gate and up in their storage dtype (silu rounded to it,
        then the product, rounded again) -> float32: the one definition the fused quantizer
        and the grouped MoE's gate/up epilogue (triton_moe_fp8) share."""
        dtype = gate.dtype
        g = gate.to(tl.float32)
        u = up.to(tl.float32)
        if HAS_LIMIT:  # limit comes rounded to x's dtype: exact in float32, as torch clamps
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        if CUDA_EXP:  # expf as torch's silu calls it (tl.exp is an approximate exp2 on CUDA)
            e = libdevice.exp(-g)
        else:  # Triton's interpreter: numpy's
            e = tl.exp(-g)
        silu = tl.div_rn(g, 1.0 + e).to(dtype).to(tl.float32)  # torch's silu, rounded
        return (silu * u).to(dtype).to(tl.float32)

    @triton.jit  # type: ignore[untyped-decorator]
    def _quantize_1x128(  # type: ignore[no-untyped-def]
        x_ptr, q_ptr, s_ptr, M, R, K, stride_xm, stride_qm, stride_sm, stride_sg,
        INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
        GROUP: tl.constexpr, PDL: tl.constexpr = False,
    ):
        enter(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
            mask=(rows[:, None] < M) & (cols[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        _quantize_store(x, rows.to(tl.int64), cols, group, rows < M, rows < R, q_ptr, s_ptr, K,
                        stride_qm, stride_sm, stride_sg, INV_FP8_MAX, MIN_SCALE)

    @triton.jit  # type: ignore[untyped-decorator]
    def _swiglu_quantize_1x128(  # type: ignore[no-untyped-def]
        x_ptr, q_ptr, s_ptr, live_ptr, M, R, K, stride_xm, stride_qm, stride_sm, stride_sg,
        limit, HAS_LIMIT: tl.constexpr, HAS_LIVE: tl.constexpr, CUDA_EXP: tl.constexpr,
        INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
        GROUP: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """torch_ref.swiglu's bf16 steps (silu rounded to x's dtype, then the product) over x's
        halves [gate | up], each 128-wide group of the result quantized as _quantize_1x128;
        HAS_LIVE: only the rows whose live_ptr entry is >= 0 read and written."""
        enter(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        real = rows < M
        kept = rows < R
        if HAS_LIVE:
            real = real & (tl.load(live_ptr + rows, mask=real, other=-1) >= 0)
            kept = real
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
        mask = real[:, None] & (cols[None, :] < K)
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        h = swiglu_steps(gate, up, limit, HAS_LIMIT, CUDA_EXP)
        _quantize_store(h, rows.to(tl.int64), cols, group, real, kept, q_ptr, s_ptr, K,
                        stride_qm, stride_sm, stride_sg, INV_FP8_MAX, MIN_SCALE)
    # fmt: on

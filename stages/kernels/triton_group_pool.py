"""The `group_pool` op (stages/kernels/group_pool.py) in one Triton kernel: a program per group
and block of channels gathers the group's token rows from the cache by slot, adds the bias,
takes the softmax over the group's slots and the weighted sum, and writes the entry. The torch
form takes ten kernels or more (the gather's copy, the fp32 gate, the masks and concatenations,
the softmax, the casts, the product, the sum), each over [G, 2 * rate, w] in fp32.

In a CUDA-graph decode step every row has a group slot of each rate whether or not its token
completes a group: at 512 rows a heavily compressed layer (rate 128) pooled 512 x 128 tokens
a step to keep 4 of them. Here a group that is not `live` reads nothing and computes nothing
(its program writes the zeros the torch form's empty softmax gives).

The same roundings as the torch form (libdevice's expf and an IEEE division, as torch's CUDA
softmax; no FMA contraction); only the order of the softmax's and the pool's sums differs.
Inputs off CUDA, or not [S, C] with unit stride, take the torch form, counted and logged once
(stages/kernels/fallbacks.py).
"""

from __future__ import annotations

import torch

from stages.kernels import group_pool as reference
from stages.kernels import pdl
from stages.kernels.fallbacks import record_fallback

# elements of a program's [slots, channels] tile (a heavily compressed group: 128 x 32)
TILE_ELEMENTS = 4096


def is_available(device: str = "cuda") -> bool:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    return triton is not None


def pool_groups(
    inputs: torch.Tensor,
    slots: torch.Tensor,
    first: torch.Tensor,
    bias: torch.Tensor,
    rate: int,
    overlap: bool,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    reason = _refusal(inputs, slots, bias, rate, overlap)
    if reason is not None:
        if slots.shape[0]:  # no group: no work on either path
            detail = f"inputs {tuple(inputs.shape)} {inputs.dtype} on {inputs.device} -> torch"
            record_fallback("group_pool", "triton", reason, detail)
        return reference.pool_groups(inputs, slots, first, bias, rate, overlap, live)
    return launch(inputs, slots, first, bias, rate, overlap, live)


def _refusal(
    inputs: torch.Tensor, slots: torch.Tensor, bias: torch.Tensor, rate: int, overlap: bool
) -> str | None:
    if triton is None:
        return "no_triton"
    if not inputs.is_cuda:
        return "device"
    if inputs.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return "dtype"
    if bias.dtype != torch.float32:
        return "dtype"
    series = 2 if overlap else 1
    if inputs.dim() != 2 or inputs.stride(-1) != 1 or inputs.shape[-1] % (2 * series):
        return "shape"
    w = inputs.shape[-1] // (2 * series)
    if bias.shape != (rate, series * w) or bias.stride(-1) != 1:
        return "shape"
    if slots.dim() != 2 or slots.shape[1] != 2 * rate or slots.stride(-1) != 1:
        return "shape"
    return None


def launch(
    inputs: torch.Tensor,
    slots: torch.Tensor,
    first: torch.Tensor,
    bias: torch.Tensor,
    rate: int,
    overlap: bool,
    live: torch.Tensor | None = None,
    tile: int = TILE_ELEMENTS,
    num_warps: int = 4,
) -> torch.Tensor:
    """The kernel's launch on any device Triton runs on (its interpreter's tests call it)."""
    g = slots.shape[0]
    w = inputs.shape[-1] // (4 if overlap else 2)
    out = torch.empty(g, w, dtype=inputs.dtype, device=inputs.device)
    if g == 0:
        return out
    block_s = triton.next_power_of_2(2 * rate if overlap else rate)
    block_w = max(16, min(triton.next_power_of_2(w), tile // block_s))
    options = {"enable_fp_fusion": False} if inputs.is_cuda else {}
    _pool_groups[(g, triton.cdiv(w, block_w))](
        inputs, slots, first, first if live is None else live, bias, out,
        w, inputs.stride(0), slots.stride(0), bias.stride(0), out.stride(0),
        RATE=rate, OVERLAP=overlap, LIVE=live is not None, CUDA_EXP=inputs.is_cuda,
        BLOCK_S=block_s, BLOCK_W=block_w, num_warps=num_warps, **options, **pdl.options(out),
    )  # fmt: skip
    return out


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
    def _pool_groups(  # type: ignore[no-untyped-def]
        in_ptr, slot_ptr, first_ptr, live_ptr, bias_ptr, out_ptr, W, stride_in, stride_slot,
        stride_bias, stride_out, RATE: tl.constexpr, OVERLAP: tl.constexpr, LIVE: tl.constexpr,
        CUDA_EXP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        enter(PDL)
        g = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        if LIVE:  # a group that does not complete is zeros, as the torch form's empty softmax
            if tl.load(live_ptr + g) != 0:
                pooled = _pool(in_ptr, slot_ptr, first_ptr, bias_ptr, g, cols, W, stride_in,
                               stride_slot, stride_bias, RATE, OVERLAP, CUDA_EXP, BLOCK_S)
            else:  # no loads and no softmax: most groups of a graphed decode step
                pooled = tl.zeros((BLOCK_W,), dtype=tl.float32)
        else:
            pooled = _pool(in_ptr, slot_ptr, first_ptr, bias_ptr, g, cols, W, stride_in,
                           stride_slot, stride_bias, RATE, OVERLAP, CUDA_EXP, BLOCK_S)
        tl.store(out_ptr + g * stride_out + cols, pooled.to(out_ptr.dtype.element_ty),
                 mask=cols < W)

    @triton.jit  # type: ignore[untyped-decorator]
    def _pool(  # type: ignore[no-untyped-def]
        in_ptr, slot_ptr, first_ptr, bias_ptr, g, cols, W, stride_in, stride_slot, stride_bias,
        RATE: tl.constexpr, OVERLAP: tl.constexpr, CUDA_EXP: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """Group g's pooled channels `cols` (float32 of values rounded to the inputs' dtype)."""
        in_w = (cols < W)[None, :]
        j = tl.arange(0, BLOCK_S)
        if OVERLAP:  # slots 0..RATE-1: group g - 1's first series; RATE..: group g's second
            used = j < 2 * RATE
            slot = tl.load(slot_ptr + g * stride_slot + j, mask=used, other=0)
            second = (j >= RATE).to(tl.int32)
            used = used & ((j >= RATE) | (tl.load(first_ptr + g) == 0))
            kv_col = cols[None, :] + (second * W)[:, None]
            gate_col = kv_col + 2 * W
            bias_row = j - second * RATE
        else:
            used = j < RATE
            slot = tl.load(slot_ptr + g * stride_slot + RATE + j, mask=used, other=0)
            kv_col = cols[None, :] + 0 * j[:, None]
            gate_col = kv_col + W
            bias_row = j
        mask = used[:, None] & in_w
        row = in_ptr + slot.to(tl.int64)[:, None] * stride_in
        kv = tl.load(row + kv_col, mask=mask, other=0.0)
        dtype = kv.dtype
        bias = tl.load(bias_ptr + bias_row[:, None] * stride_bias + kv_col, mask=mask, other=0.0)
        gate = tl.load(row + gate_col, mask=mask, other=0.0).to(tl.float32) + bias
        gate = tl.where(mask, gate, float("-inf"))
        top = tl.max(gate, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # channels past W: every gate -inf
        if CUDA_EXP:  # expf, as torch's CUDA softmax
            e = libdevice.exp(gate - top[None, :])
        else:
            e = tl.exp(gate - top[None, :])
        total = tl.sum(e, axis=0)
        weight = tl.div_rn(e, tl.where(total == 0.0, 1.0, total)[None, :]).to(dtype)
        product = (kv.to(tl.float32) * weight.to(tl.float32)).to(dtype)  # rounded, as torch's
        return tl.sum(product.to(tl.float32), axis=0)
    # fmt: on
